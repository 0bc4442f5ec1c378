"""Stop 68, reasoning in the history (docs/traceability.md "Found at stop 68 (reasoning)"):
clients that talked to a reasoning server (vLLM with ``--reasoning-parser qwen3``) send an
assistant's reasoning back in the history, as ``reasoning_content`` (vLLM up to 0.10,
DeepSeek; litellm, pydantic-ai and the SDK's ``model_dump()`` pass it on) or ``reasoning``
(vLLM's name since); each was a 400 "unknown parameter". vLLM gives it to the chat template
as both names; Qwen3's template writes it in ``<think>`` for the turns after the last user
query (a tool loop) and drops it before. The bodies: ``tests/data/reasoning68/bodies.json``,
recorded from the clients against a recording stand-in for such a server (its ``_about``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import needs
from calexec.drivers.serving.byte_tokenizer import ByteTokenizer
from calexec.drivers.serving.openai_api import ChatMessage, Refusal, render_chat
from test_server_support import MODEL, live_fixture  # noqa: F401 - the ``live`` fixture

httpx = needs.module("httpx", "server")

DATA = Path(__file__).parent / "data" / "reasoning68"
BODIES = json.loads((DATA / "bodies.json").read_text(encoding="utf-8"))
CASES = [(name, i) for name, rows in BODIES.items() if not name.startswith("_")
         for i in range(len(rows))]
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking_blocks")
THINK = "The user wants the weather; call the tool first."
CALL = {"id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TIMEOUT_S = 30.0


def qwen3() -> ByteTokenizer:
    """A tokenizer whose chat template is Qwen3's (tests/data/reasoning68)."""
    needs.module("jinja2", "tokenizer")
    tok = ByteTokenizer()
    tok.chat_template = (DATA / "qwen3_chat_template.jinja").read_text(encoding="utf-8")
    return tok


def without_reasoning(body: dict) -> dict:
    """``body`` with its messages' reasoning fields taken out."""
    body = copy.deepcopy(body)
    for m in body["messages"]:
        for key in REASONING_KEYS:
            m.pop(key, None)
    return body


def carries_reasoning(body: dict) -> bool:
    return any(m.get(k) for m in body.get("messages", ()) for k in ("reasoning_content",
                                                                     "reasoning"))


def test_the_recorded_bodies_send_reasoning_back_under_both_names():
    """The data holds what the probe saw: each client sends a reasoning server's
    ``reasoning_content``, and ``reasoning``, back in an assistant message (a drop in a
    re-record fails here)."""
    sent = {(name.split("/")[0], k) for name, rows in BODIES.items() if not name.startswith("_")
            for row in rows for m in row["body"]["messages"] for k in REASONING_KEYS
            if m.get(k)}
    assert {("openai", "reasoning_content"), ("openai", "reasoning"),
            ("litellm", "reasoning_content"), ("pydantic_ai", "reasoning_content")} <= sent, sent


@pytest.mark.parametrize(("name", "i"), CASES)
def test_each_recorded_body_is_answered_and_its_reasoning_kept_out_of_the_plain_prompt(
        live, name, i):
    """Every recorded body is answered 200 (those with reasoning in the history were a 400
    ``unknown parameter``); the plain template (the byte-level tokenizer's) does not write
    reasoning, so the prompt is the one of the same body without it; ``/tokenize`` of the
    messages counts it as the chat does."""
    server, _, _ = live
    body = {**BODIES[name][i]["body"], "model": MODEL, "max_tokens": 2, "stream": False}
    body.pop("stream_options", None)
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert "reasoning_content" not in answer["choices"][0]["message"]
    if carries_reasoning(body):
        plain = httpx.post(f"{server.url}/v1/chat/completions", json=without_reasoning(body),
                           timeout=TIMEOUT_S)
        assert plain.status_code == 200, plain.text
        assert answer["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
        # vLLM's /tokenize of the same messages (and tools) counts the chat's prompt
        counted = httpx.post(f"{server.url}/tokenize", timeout=TIMEOUT_S, json={
            "messages": body["messages"],
            **({"tools": body["tools"]} if body.get("tools") else {})})
        assert counted.status_code == 200, counted.text
        assert counted.json()["count"] == answer["usage"]["prompt_tokens"]


def test_qwen3s_template_writes_the_reasoning_of_a_tool_loop_in_think():
    """An assistant's tool call after the last user query, sent back with its
    ``reasoning_content`` (or vLLM's ``reasoning``), is written as Qwen3 wrote it: in
    ``<think>`` before the call; the final turn after a new user query drops it (the
    template's choice, as with vLLM)."""
    tok = qwen3()
    head = "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    tool = ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for key in ("reasoning_content", "reasoning"):
        messages = [ChatMessage(role="user", content="Weather in Paris?"),
                    ChatMessage(role="assistant", content=None, tool_calls=[CALL],
                                **{key: THINK}),
                    ChatMessage(role="tool", tool_call_id="call_abc", content="sunny")]
        assert render_chat(messages, tok) == (
            f"{head}<|im_start|>assistant\n<think>\n{THINK}\n</think>\n\n{call}<|im_end|>\n"
            f"{tool}"), key
    # a finished turn before the last user query: Qwen3 drops its reasoning
    done = [ChatMessage(role="user", content="Weather in Paris?"),
            ChatMessage(role="assistant", content="Sunny.", reasoning_content=THINK),
            ChatMessage(role="user", content="And tomorrow?")]
    assert THINK not in render_chat(done, tok)
    # the plain template does not write reasoning: as the same messages without it
    plain = [ChatMessage(role="user", content="Weather in Paris?"),
             ChatMessage(role="assistant", content=None, tool_calls=[CALL],
                         reasoning_content=THINK),
             ChatMessage(role="tool", tool_call_id="call_abc", content="sunny")]
    assert render_chat(plain, ByteTokenizer()) == render_chat(
        [plain[0], ChatMessage(role="assistant", content=None, tool_calls=[CALL]), plain[2]],
        ByteTokenizer())


def test_a_reply_cut_while_it_reasoned_is_taken_back_with_its_reasoning_only():
    """A reply cut by ``max_tokens`` while the model reasoned has ``content`` null and its
    reasoning: sent back, it is an assistant message with nothing but reasoning (vLLM takes
    it); it was refused as a message without content."""
    tok = qwen3()
    messages = [ChatMessage(role="user", content="hi"),
                ChatMessage(role="assistant", content=None, reasoning_content="Hmm")]
    assert render_chat(messages, tok, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nHmm\n</think>\n\n"
        "<|im_end|>\n")


@pytest.mark.parametrize(("message", "param", "words"), [
    ({"role": "assistant", "content": "a", "reasoning_content": 5},
     "messages.1.reasoning_content", "valid string"),
    ({"role": "assistant", "content": "a", "reasoning": ["x"]}, "messages.1.reasoning",
     "valid string"),
    ({"role": "assistant", "content": "a", "reasoning_content": "x", "reasoning": "y"},
     "messages.1.reasoning", "differs from its reasoning_content"),
    ({"role": "user", "content": "a", "reasoning_content": "x"},
     "messages.1.reasoning_content", "only an assistant message carries reasoning"),
    ({"role": "assistant", "content": "a",
      "thinking_blocks": [{"type": "thinking", "thinking": "x", "signature": "s"}]},
     "messages.1.thinking_blocks", "send the reasoning text as reasoning_content"),
    ({"role": "assistant", "content": "a", "thinking_blocks": "x"},
     "messages.1.thinking_blocks", "valid array"),
    ({"role": "assistant", "content": "a", "reasoning_content": "x",
      "provider_specific_fields": {"reasoning": "y"}},
     "messages.1.provider_specific_fields.reasoning", "differs from its reasoning_content"),
    ({"role": "assistant", "content": "a", "provider_specific_fields": {"reasoning": 5}},
     "messages.1.provider_specific_fields.reasoning", "must be a string"),
])
def test_bad_reasoning_fields_are_400s_naming_the_field(live, message, param, words):
    server, _, _ = live
    body = {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}, message]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"] and param in error["message"].replace("[1]", ".1"), error


def test_null_and_equal_reasoning_fields_are_taken():
    """``reasoning_content: null`` (the SDK's ``model_dump()`` of a reply without reasoning),
    ``thinking_blocks: null`` or ``[]`` (litellm's dump), both names with one text, litellm's
    ``provider_specific_fields`` (its copy of a reply's ``reasoning``, other keys
    metadata): taken, the reasoning given to the template once."""
    tok = qwen3()
    for extra, reasoning in (
            ({"reasoning_content": None, "reasoning": None, "thinking_blocks": None}, ""),
            ({"thinking_blocks": []}, ""), ({"reasoning_content": "r", "reasoning": "r"}, "r"),
            ({"provider_specific_fields": {"reasoning": "r", "citations": None}}, "r"),
            ({"reasoning_content": "r", "provider_specific_fields": {"reasoning": "r"}}, "r")):
        messages = [ChatMessage(role="user", content="hi"),
                    ChatMessage(role="assistant", content="yo", **extra)]
        text = render_chat(messages, tok, add_generation_prompt=False)
        assert text == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                        f"<think>\n{reasoning}\n</think>\n\nyo<|im_end|>\n"), extra
    with pytest.raises(Refusal):
        render_chat([ChatMessage(role="assistant", content="yo", reasoning_content="a",
                                 reasoning="b")], tok)
