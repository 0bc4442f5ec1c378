"""The OpenAI surface against what vLLM's and llama.cpp's own server suites pin (stop 48):
behaviours of fields this server supports that a client pointed at it instead of vLLM or
llama-server would notice, checked through the official ``openai`` client and raw ``httpx``
against a loopback server on the synthetic model (its greedy tokens are the numpy oracle's;
the byte-level tokenizer renders every id outside 256..511 as ``<id>``, so ``"><"`` spans two
tokens). Each test names the vLLM or llama.cpp source it follows. Compared files are listed in
docs/server.md ("Real clients and peer suites").
"""

from __future__ import annotations

import json

import httpx
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from test_server_support import MODEL, live_fixture, oracle_tokens  # noqa: F401 - `live`


def _stream(url: str, body: dict) -> list[dict]:
    """The data events of a streamed answer (``[DONE]`` left out; it must be the last)."""
    events: list[str] = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _rendered(tokens: list[int]) -> str:
    return "".join(f"<{t}>" for t in tokens)


# ---- min_tokens and stop strings (vllm tests/detokenizer/test_min_tokens.py) -----------------
@pytest.mark.parametrize("min_tokens", [0, 1, 4])
def test_a_stop_string_ends_the_text_only_after_min_tokens(live, min_tokens):
    # vllm tests/detokenizer/test_min_tokens.py::test_min_tokens_with_stop: with min_tokens=5
    # and stop "e", " is Lee, ..." goes on past the "e" of " Lee" (vLLM's detokenizer checks
    # stop strings once more than min_tokens tokens were generated, and only for a match that
    # ends in the text after them: vllm/v1/engine/detokenizer.py). Here every two tokens meet
    # in "><": a stop string "><" may end the text only in token min_tokens + 1's text, which
    # is the boundary between tokens min_tokens and min_tokens + 1 (at least token 2).
    server, client, _ = live
    prompt = tokenizer.encode("hello")
    oracle = oracle_tokens(prompt, 8)
    kept = max(min_tokens, 1)  # the tokens whose whole text is kept before the stop string
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stop": ["><"],
            "min_tokens": min_tokens}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    choice = whole["choices"][0]
    assert choice["text"] == _rendered(oracle[:kept])[:-1]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == oracle[:kept + 1]
    assert whole["usage"]["completion_tokens"] == kept + 1
    chunks = _stream(f"{server.url}/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # every choice of a request of several (n) takes the same rule
    several = httpx.post(f"{server.url}/v1/completions", json={**body, "n": 2}, timeout=30)
    assert [c["text"] for c in several.json()["choices"]] == [choice["text"]] * 2
    # the chat route takes the same rule
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        stop=["><"], extra_body={"min_tokens": min_tokens})
    assert chat.choices[0].finish_reason == "stop"
    assert chat.usage.completion_tokens == kept + 1
    assert chat.choices[0].message.content.count("><") == kept - 1


# ---- a stop token is generated: counted, in token_ids and logprobs (vllm tests/detokenizer/
# test_stop_token_ids.py) ---------------------------------------------------------------------
def test_a_stop_token_is_counted_and_listed_but_not_written(live):
    # vllm tests/detokenizer/test_stop_token_ids.py::test_stop_token_id_excluded_from_output and
    # ::test_stop_token_id_included_in_output: "hello" then the stop id "!" gives the text
    # "hello" ("hello!" with include_stop_str_in_output) and output_token_ids "hello!"; vLLM's
    # OpenAI server counts those ids in usage.completion_tokens and lists them in token_ids
    # and logprobs (vllm/entrypoints/openai/completion/serving.py).
    server, client, _ = live
    prompt = tokenizer.encode("hi")
    oracle = oracle_tokens(prompt, 5)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "stop_token_ids": [oracle[2]],
            "logprobs": 0}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == _rendered(oracle[:2])
    assert choice["token_ids"] == oracle[:3]
    assert whole["usage"]["completion_tokens"] == 3
    assert whole["usage"]["total_tokens"] == len(prompt) + 3
    assert choice["logprobs"]["tokens"] == [f"<{t}>" for t in oracle[:3]]
    chunks = _stream(f"{server.url}/v1/completions",
                     {**body, "stream_options": {"include_usage": True}})
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in streamed) == choice["text"]
    assert [t for c in streamed for t in c["token_ids"]] == oracle[:3]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [x for c in streamed for x in c["logprobs"][key]] == choice["logprobs"][key]
    assert chunks[-1]["usage"] == whole["usage"]
    # each choice of a request of several (n) the same, streamed
    ids: dict[int, list[int]] = {0: [], 1: []}
    for chunk in _stream(f"{server.url}/v1/completions", {**body, "n": 2}):
        ids[chunk["choices"][0]["index"]] += chunk["choices"][0]["token_ids"]
    assert ids == {0: oracle[:3], 1: oracle[:3]}
    # include_stop_str_in_output writes the stop token's text too
    kept = httpx.post(f"{server.url}/v1/completions", timeout=30,
                      json={**body, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == _rendered(oracle[:3])
    kept_chunks = _stream(f"{server.url}/v1/completions",
                          {**body, "include_stop_str_in_output": True})
    assert "".join(c["choices"][0]["text"] for c in kept_chunks) == _rendered(oracle[:3])
    # chat: the same count, ids and logprobs, whole and streamed
    messages = [{"role": "user", "content": "hi"}]
    chat_oracle = oracle_tokens(tokenizer.encode("user: hi\nassistant:"), 5)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                          logprobs=True,
                                          extra_body={"stop_token_ids": [chat_oracle[1]]})
    assert chat.choices[0].message.content == _rendered(chat_oracle[:1])
    assert chat.usage.completion_tokens == 2
    assert chat.choices[0].model_extra["token_ids"] == chat_oracle[:2]
    assert [c.token for c in chat.choices[0].logprobs.content] == \
        [f"<{t}>" for t in chat_oracle[:2]]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, logprobs=True, stream=True,
        stream_options={"include_usage": True},
        extra_body={"stop_token_ids": [chat_oracle[1]]})
    ids, tokens, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            ids += (c.model_extra or {}).get("token_ids") or []
            tokens += [t.token for t in (c.logprobs.content if c.logprobs else None) or []]
    assert ids == chat_oracle[:2]
    assert tokens == [f"<{t}>" for t in chat_oracle[:2]]
    assert usage.completion_tokens == 2


# ---- deliberate differences, pinned -------------------------------------------------------------
def test_a_chat_stream_ends_with_a_finish_chunk_of_its_own(live):
    # vllm tests/entrypoints/openai/chat_completion/test_chat.py::test_chat_streaming asserts
    # `delta.content` on the chunk that carries the finish_reason (vLLM sends it with the last
    # token). This server sends the finish_reason on a chunk of its own, as OpenAI's stream
    # does, whose delta holds only what a stop string held back (here nothing): every token's
    # text came before it, in order (docs/server.md, "Chat").
    _, client, _ = live
    messages = [{"role": "user", "content": "what is 1+1?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                 stream=True))
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert finishing == [chunks[-1]]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].delta.content is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content


def test_token_ids_are_sent_without_return_token_ids(live):
    # vllm tests/entrypoints/openai/basic/test_return_token_ids.py::
    # test_basic_completion_with_emoji: without return_token_ids vLLM sends no `token_ids`
    # (and no `prompt_token_ids`). Here a choice always carries its `token_ids` (a calexec
    # extension the docs promise); `prompt_token_ids` only when asked for, as vLLM.
    server, _, _ = live
    prompt = tokenizer.encode("hi")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).json()[
        "choices"][0]
    assert choice["token_ids"] == oracle_tokens(prompt, 3)
    assert "prompt_token_ids" not in choice
    asked = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": True},
                       timeout=30).json()["choices"][0]
    assert asked["prompt_token_ids"] == prompt


def test_a_chat_without_max_tokens_gets_at_most_256_tokens(live):
    # vLLM's chat default max_tokens is what the context leaves after the prompt
    # (max_model_len - prompt); here 256 (openai_api.CHAT_DEFAULT_MAX_TOKENS), or less when
    # the context leaves less: the KV of prompt + max_tokens is reserved up front, and the
    # context's rest would reserve ~40k tokens of KV for every chat (docs/server.md).
    _, client, _ = live
    chat = client.chat.completions.create(model=MODEL,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 256
    assert chat.choices[0].finish_reason == "length"


def test_an_error_in_a_stream_is_its_last_event_without_done(live):
    # vLLM's serving_completion/serving_chat stream generators send `data: [DONE]` after the
    # `data: {"error": ...}` event of a failure mid-stream. Here the error event is the
    # stream's last (the official SDK raises on it either way): a stream without `[DONE]` is
    # one that did not end well, which the fleet ingress relies on to continue it on a sibling
    # (docs/server.md, "A failed choice" and "Across replicas"). The request's own timeout
    # (2 s, far short of 40000 tokens) ends it after its first tokens.
    server, _, _ = live
    body = {"model": MODEL, "prompt": [40, 41], "max_tokens": 40000, "ignore_eos": True,
            "timeout": 2, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["token_ids"]  # tokens were streamed first
    last = json.loads(events[-1])
    assert last["error"]["code"] in ("wait.deadline", "submit.deadline", "admission.deadline")
    assert "[DONE]" not in events


# ---- two stop strings in one token's text (vllm/v1/engine/detokenizer.py check_stop_strings) --
def test_two_stop_strings_in_one_tokens_text_cut_at_the_earliest_not_the_first_listed():
    """A pinned difference: vLLM's ``check_stop_strings`` tries the stop strings in list order
    and cuts at the first one found in the new text, so with ``stop=["3>", "<1"]`` and a token
    whose text is ``<123>`` it answers ``<12``, which holds the other stop string. Here the
    text is cut at the earliest match in the text, whatever the list's order (OpenAI: the
    text stops before the first stop sequence it contains), so the answer never holds one."""
    from calexec.drivers.serving.byte_tokenizer import ByteTokenizer
    from calexec.drivers.serving.openai_api import TextOutput

    tok = ByteTokenizer()
    assert tok.decode([123]) == "<123>"
    for stop in (("3>", "<1"), ("<1", "3>")):
        out = TextOutput(tok, stop)
        sent = out.add(123) + out.flush()
        assert out.stopped and out.text == sent == "", (stop, out.text)
    kept = TextOutput(tok, ("3>", "<1"), keep_stop=True)
    assert kept.add(123) + kept.flush() == "<1"  # include_stop_str_in_output: that match
