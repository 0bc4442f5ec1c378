"""Tests ported from llama.cpp's server suite (ggml-org/llama.cpp, tools/server/tests/unit/),
issue 27: the ones that apply to this server's OpenAI-compatible routes, against a loopback
server on the synthetic model. Each test names its source file and test. Adapted: llama's
native ``/completion`` (``n_predict``, ``content``, ``timings``) becomes ``/v1/completions``
(``max_tokens``, ``choices``, ``usage``); the regexes over TinyLlama's text become the numpy
oracle's greedy text; llama's own fields (``system_fingerprint`` "b<build>",
``exceed_context_size_error`` with ``n_ctx``, ``/slots``) become OpenAI's (the
``context_length_exceeded`` code). Not ported: the native routes alone (``/completion``
fields, ``/apply-template``, ``/slots``), grammars and JSON schemas (the structured-outputs
branch), context shifting (this server refuses a request that does not fit: the disabled
case is ported), multimodal, LoRA, speculative decoding.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.server import ServerConfig
from test_server_support import MODEL, live_fixture, openai_server, oracle_tokens  # noqa: F401

PROMPT = "I believe the meaning of life is"
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]


def _chat_prompt(messages: list[dict]) -> list[int]:
    """The plain template's prompt ids (no tokenizer.json: the byte-level tokenizer)."""
    return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages)
                            + "assistant:")


def _greedy(ids: list[int], n: int) -> str:
    return tokenizer.decode(oracle_tokens(ids, n))


# ---- unit/test_completion.py ------------------------------------------------------------------
def test_completion_with_openai_library(live):
    # llama.cpp tools/server/tests/unit/test_completion.py::test_completion_with_openai_library
    _, client, _ = live
    res = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
    assert res.choices[0].finish_reason == "length"
    assert res.choices[0].text is not None
    assert res.choices[0].text == _greedy(tokenizer.encode(PROMPT), 8)


def test_completion_stream_with_openai_library(live):
    # llama.cpp .../unit/test_completion.py::test_completion_stream_with_openai_library
    _, client, _ = live
    output_text = ""
    for data in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                          stream=True):
        choice = data.choices[0]
        if choice.finish_reason is None:
            assert choice.text is not None
            output_text += choice.text
    assert output_text == _greedy(tokenizer.encode(PROMPT), 8)


def test_completion_stream_vs_non_stream(live):
    # llama.cpp .../unit/test_completion.py::test_completion_stream_vs_non_stream
    server, _, _ = live
    body = {"max_tokens": 8, "prompt": PROMPT}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=10) as r:
        content_stream = "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in r.iter_lines() if line.startswith("data: {"))
    res = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    assert content_stream == res.json()["choices"][0]["text"]


def test_consistent_result_same_seed(live):
    # llama.cpp .../unit/test_completion.py::test_consistent_result_same_seed
    _, client, _ = live
    texts = {client.completions.create(model=MODEL, prompt=PROMPT, seed=42, temperature=0.0,
                                       max_tokens=16).choices[0].text for _ in range(4)}
    assert len(texts) == 1


def test_different_result_different_seed(live):
    # llama.cpp .../unit/test_completion.py::test_different_result_different_seed
    _, client, _ = live
    last = None
    for seed in range(4):
        text = client.completions.create(model=MODEL, prompt=PROMPT, seed=seed,
                                         temperature=1.0, max_tokens=16).choices[0].text
        assert text != last
        last = text


def test_nocache_long_input_prompt(live):
    # llama.cpp .../unit/test_completion.py::test_nocache_long_input_prompt (a prompt longer
    # than the context: 400; here longer than max_model_len)
    server, client, _ = live
    max_len = client.models.retrieve(MODEL).model_extra["max_model_len"]
    long_prompt = PROMPT * (max_len // len(PROMPT) + 1)
    res = httpx.post(f"{server.url}/v1/completions", timeout=10,
                     json={"prompt": long_prompt, "seed": 42, "temperature": 1.0})
    assert res.status_code == 400


def test_completion_with_tokens_input(live):
    # llama.cpp .../unit/test_completion.py::test_completion_with_tokens_input (single and
    # batch; its mixed string-and-ids prompts are llama-server's own, outside the OpenAI type)
    server, _, _ = live
    res = httpx.post(f"{server.url}/tokenize", json={"content": PROMPT, "add_special": True},
                     timeout=10)
    assert res.status_code == 200
    tokens = res.json()["tokens"]
    res = httpx.post(f"{server.url}/v1/completions", json={"prompt": tokens, "temperature": 0},
                     timeout=10)
    assert res.status_code == 200
    assert isinstance(res.json()["choices"][0]["text"], str)
    res = httpx.post(f"{server.url}/v1/completions",
                     json={"prompt": [tokens, tokens], "temperature": 0}, timeout=10)
    assert res.status_code == 200
    choices = res.json()["choices"]
    assert len(choices) == 2
    assert choices[0]["text"] == choices[1]["text"]
    res = httpx.post(f"{server.url}/v1/completions", json={"prompt": [PROMPT, PROMPT]},
                     timeout=10)
    assert res.status_code == 200
    assert res.json()["choices"][0]["text"] == choices[0]["text"]


@pytest.mark.parametrize("n_requests", [2, 6])
def test_completion_parallel_slots(live, n_requests):
    # llama.cpp .../unit/test_completion.py::test_completion_parallel_slots (its /slots check
    # is llama's own; every concurrent request answers 200 with content)
    server, _, _ = live
    prompts = ["Write a very long book.", "Write another a poem.", "What is LLM?",
               "The sky is blue and I love it.", "Write another very long music lyrics.",
               "Write a very long joke."]

    def one(i: int) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", timeout=20,
                          json={"prompt": prompts[i % len(prompts)], "seed": 42,
                                "temperature": 1.0, "max_tokens": 16})

    with concurrent.futures.ThreadPoolExecutor(n_requests) as pool:
        results = list(pool.map(one, range(n_requests), timeout=30))
    for res in results:
        assert res.status_code == 200
        assert isinstance(res.json()["choices"][0]["text"], str)
        assert len(res.json()["choices"][0]["text"]) > 10


def test_n_probs(live):
    # llama.cpp .../unit/test_completion.py::test_n_probs (n_probs: 10 on /completion is
    # logprobs: 10 on /v1/completions)
    _, client, _ = live
    res = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=10, temperature=0.0,
                                    max_tokens=5)
    lp = res.choices[0].logprobs
    assert len(lp.tokens) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(token, str)
        assert logprob <= 0.0
        assert len(top) == 10
        assert all(isinstance(t, str) and v <= 0.0 for t, v in top.items())


# ---- unit/test_chat_completion.py ---------------------------------------------------------------
def test_chat_completion(live):
    # llama.cpp .../unit/test_chat_completion.py::test_chat_completion
    server, _, _ = live
    res = httpx.post(f"{server.url}/v1/chat/completions", timeout=10,
                     json={"model": None, "max_tokens": 8, "messages": BOOK})
    assert res.status_code == 200
    body = res.json()
    assert "cmpl" in body["id"]
    assert body["usage"]["prompt_tokens"] == len(_chat_prompt(BOOK))
    assert body["usage"]["completion_tokens"] == 8
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == _greedy(_chat_prompt(BOOK), 8)
    assert choice["finish_reason"] == "length"


def test_chat_completion_stream(live):
    # llama.cpp .../unit/test_chat_completion.py::test_chat_completion_stream
    server, _, _ = live
    content, last_cmpl_id, finished = "", None, 0
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=10,
                      json={"max_tokens": 8, "messages": BOOK, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    for i, line in enumerate(lines):
        data = json.loads(line[6:])
        choice = data["choices"][0]
        if i == 0:
            assert choice["delta"]["role"] == "assistant"
            assert not choice["delta"].get("content")
        else:
            assert "role" not in choice["delta"]
        assert data["model"] == MODEL
        last_cmpl_id = last_cmpl_id or data["id"]
        assert last_cmpl_id == data["id"]
        if choice["finish_reason"] in ("stop", "length"):
            assert "content" not in choice["delta"]
            assert content == _greedy(_chat_prompt(BOOK), 8)
            assert choice["finish_reason"] == "length"
            finished += 1
        else:
            assert choice["finish_reason"] is None
            content += choice["delta"].get("content") or ""
    assert finished == 1


def test_chat_completion_with_openai_library(live):
    # llama.cpp .../unit/test_chat_completion.py::test_chat_completion_with_openai_library
    _, client, _ = live
    res = client.chat.completions.create(model=MODEL, messages=BOOK, max_tokens=8, seed=42,
                                         temperature=0.8)
    assert res.choices[0].finish_reason == "length"
    assert res.choices[0].message.content is not None


@pytest.mark.parametrize("messages", [
    None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
    [{"role": "system", "content": "test"}, {}]])
def test_invalid_chat_completion_req(live, messages):
    # llama.cpp .../unit/test_chat_completion.py::test_invalid_chat_completion_req (without its
    # two consecutive assistant messages: a restriction of llama's templates, not of OpenAI's)
    server, _, _ = live
    res = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages},
                     timeout=10)
    assert res.status_code in (400, 500)
    assert "error" in res.json()


def test_logprobs(live):
    # llama.cpp .../unit/test_chat_completion.py::test_logprobs
    _, client, _ = live
    res = client.chat.completions.create(model=MODEL, temperature=0.0, messages=BOOK,
                                         max_tokens=5, logprobs=True, top_logprobs=10)
    output_text = res.choices[0].message.content
    aggregated_text = ""
    assert res.choices[0].logprobs is not None
    assert res.choices[0].logprobs.content is not None
    for token in res.choices[0].logprobs.content:
        aggregated_text += token.token
        assert token.logprob <= 0.0
        assert token.bytes is not None
        assert len(token.top_logprobs) > 0
    assert aggregated_text == output_text


def test_logprobs_stream(live):
    # llama.cpp .../unit/test_chat_completion.py::test_logprobs_stream
    _, client, _ = live
    res = client.chat.completions.create(model=MODEL, temperature=0.0, messages=BOOK,
                                         max_tokens=5, logprobs=True, top_logprobs=10,
                                         stream=True)
    output_text, aggregated_text = "", ""
    for i, data in enumerate(res):
        if not data.choices:
            continue
        choice = data.choices[0]
        if i == 0:
            assert not choice.delta.content
            assert choice.delta.role == "assistant"
        else:
            assert choice.delta.role is None
            if choice.finish_reason is None:
                if choice.delta.content:
                    output_text += choice.delta.content
                assert choice.logprobs is not None
                assert choice.logprobs.content is not None
                for token in choice.logprobs.content:
                    aggregated_text += token.token
                    assert token.logprob <= 0.0
                    assert token.bytes is not None
                    assert token.top_logprobs is not None
                    assert len(token.top_logprobs) > 0
    assert aggregated_text == output_text


def test_logit_bias(live):
    # llama.cpp .../unit/test_chat_completion.py::test_logit_bias (its excluded words, through
    # /tokenize; the synthetic model's greedy tokens are excluded too, so the bias must act)
    server, client, _ = live
    exclude = ["i", "I", "the", "The", "to", "a", "an", "be", "is", "was", "but", "But", "and",
               "book", "Book"]
    res = httpx.post(f"{server.url}/tokenize", json={"content": " " + " ".join(exclude) + " "},
                     timeout=10)
    assert res.status_code == 200
    greedy = oracle_tokens(_chat_prompt(BOOK), 8)
    banned = set(res.json()["tokens"]) | set(greedy)
    res = client.chat.completions.create(model=MODEL, temperature=0.0, messages=BOOK,
                                         max_tokens=8, logit_bias={t: -100 for t in banned},
                                         logprobs=True)
    output_text = res.choices[0].message.content
    assert output_text
    assert all(output_text.find(" " + tok + " ") == -1 for tok in exclude)
    assert not banned & set(res.choices[0].model_extra["token_ids"])


def test_context_size_exceeded(live):
    # llama.cpp .../unit/test_chat_completion.py::test_context_size_exceeded (llama's own error
    # type and n_ctx fields become OpenAI's code)
    server, client, _ = live
    # llama: BOOK * 100 overflows its 256-token test context; here max_model_len (40960)
    too_long = BOOK * (client.models.retrieve(MODEL).model_extra["max_model_len"] // 30)
    res = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": too_long},
                     timeout=10)
    assert res.status_code == 400
    assert "error" in res.json()
    assert res.json()["error"]["code"] == "context_length_exceeded"
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=10,
                      json={"messages": too_long, "stream": True}) as r:
        r.read()
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"


def test_chat_completions_multiple_choices(live):
    # llama.cpp .../unit/test_chat_completion.py::test_chat_completions_multiple_choices
    server, _, _ = live
    res = httpx.post(f"{server.url}/v1/chat/completions", timeout=10,
                     json={"max_tokens": 8, "n": 2, "messages": BOOK})
    assert res.status_code == 200
    assert len(res.json()["choices"]) == 2
    for choice in res.json()["choices"]:
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == _greedy(_chat_prompt(BOOK), 8)
        assert choice["finish_reason"] == "length"


# ---- unit/test_ctx_shift.py -----------------------------------------------------------------------
def test_ctx_shift_disabled_long_prompt(live):
    # llama.cpp .../unit/test_ctx_shift.py::test_ctx_shift_disabled_long_prompt
    server, client, _ = live
    max_len = client.models.retrieve(MODEL).model_extra["max_model_len"]
    res = httpx.post(f"{server.url}/v1/completions", timeout=10,
                     json={"max_tokens": 64, "prompt": "Lorem ipsum " * (max_len // 12 + 1)})
    assert res.status_code != 200
    assert "error" in res.json()
    assert "maximum context length" in res.json()["error"]["message"]


def test_ctx_shift_disabled_stream(live):
    # llama.cpp .../unit/test_ctx_shift.py::test_ctx_shift_disabled_stream
    _, client, _ = live
    content = ""
    for data in client.completions.create(model=MODEL, max_tokens=32, prompt="Once",
                                          stream=True):
        choice = data.choices[0]
        if choice.finish_reason == "length":
            assert len(content) > 0
        else:
            assert choice.finish_reason is None
            content += choice.text


# ---- unit/test_tokenize.py --------------------------------------------------------------------------
@pytest.mark.xfail(strict=True, reason="known difference: llama-server answers /detokenize "
                   "with {content}, vLLM with {prompt} (its test checks the exact body); this "
                   "server keeps vLLM's")
def test_tokenize_detokenize(live):
    # llama.cpp .../unit/test_tokenize.py::test_tokenize_detokenize
    server, _, _ = live
    content = "What is the capital of France ?"
    res_tok = httpx.post(f"{server.url}/tokenize", json={"content": content}, timeout=10)
    assert res_tok.status_code == 200
    assert len(res_tok.json()["tokens"]) > 5
    res_detok = httpx.post(f"{server.url}/detokenize",
                           json={"tokens": res_tok.json()["tokens"]}, timeout=10)
    assert res_detok.status_code == 200
    assert res_detok.json()["content"].strip() == content


def test_tokenize_with_pieces(live):
    # llama.cpp .../unit/test_tokenize.py::test_tokenize_with_pieces
    server, _, _ = live
    content = "This is a test string with unicode 媽 and emoji 🤗"
    res_tok = httpx.post(f"{server.url}/tokenize", json={"content": content,
                                                          "with_pieces": True}, timeout=10)
    assert res_tok.status_code == 200
    for token in res_tok.json()["tokens"]:
        assert "id" in token
        assert token["id"] > 0
        assert "piece" in token
        assert len(token["piece"]) > 0


# ---- unit/test_security.py ----------------------------------------------------------------------------
TEST_API_KEY = "sk-this-is-the-secret-key"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), ServerConfig(api_key=TEST_API_KEY),
                       timeout=10) as (server, _, _):
        yield server


def test_access_public_endpoint(secured):
    # llama.cpp .../unit/test_security.py::test_access_public_endpoint (/health; llama's
    # /models is public there, OpenAI's /v1/models needs the key)
    res = httpx.get(f"{secured.url}/health", timeout=10)
    assert res.status_code == 200
    assert "error" not in res.text


@pytest.mark.parametrize("api_key", [None, "invalid-key"])
def test_incorrect_api_key(secured, api_key):
    # llama.cpp .../unit/test_security.py::test_incorrect_api_key
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res = httpx.post(f"{secured.url}/v1/completions", json={"prompt": PROMPT},
                     headers=headers, timeout=10)
    assert res.status_code == 401
    assert "error" in res.json()
    assert res.json()["error"]["type"] == "authentication_error"


def test_correct_api_key(secured):
    # llama.cpp .../unit/test_security.py::test_correct_api_key
    res = httpx.post(f"{secured.url}/v1/completions", json={"prompt": PROMPT},
                     headers={"Authorization": f"Bearer {TEST_API_KEY}"}, timeout=10)
    assert res.status_code == 200
    assert "error" not in res.json()
    assert "choices" in res.json()


def test_openai_library_correct_api_key(secured):
    # llama.cpp .../unit/test_security.py::test_openai_library_correct_api_key
    client = openai.OpenAI(api_key=TEST_API_KEY, base_url=f"{secured.url}/v1", max_retries=0,
                           timeout=10)
    res = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You are a chatbot."},
                               {"role": "user", "content": "What is the meaning of life?"}])
    assert len(res.choices) == 1


@pytest.fixture(scope="module")
def cors(tmp_path_factory):
    config = ServerConfig(cors_origins=("http://web.mydomain.fr",))
    with openai_server(tmp_path_factory.mktemp("calbin"), config, timeout=10) as (server, _, _):
        yield server


@pytest.mark.parametrize(("cors_header", "expected"), [
    ("Access-Control-Allow-Origin", "http://web.mydomain.fr"),
    ("Access-Control-Allow-Methods", "POST")])
def test_cors_options(cors, cors_header, expected):
    # llama.cpp .../unit/test_security.py::test_cors_options (llama allows any origin; here
    # CORS is off unless --cors-origin names one, so the origin is configured)
    res = httpx.options(f"{cors.url}/v1/completions", timeout=10, headers={
        "Origin": "http://web.mydomain.fr", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization"})
    assert res.status_code == 200
    assert cors_header in res.headers
    assert expected in res.headers[cors_header]
