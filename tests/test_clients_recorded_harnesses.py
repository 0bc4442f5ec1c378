"""Evaluation harnesses' requests, recorded from the real harness against a loopback server
and replayed here over httpx (stop 63, clients/harnesses), so CI needs no harness installed.

- UK AISI's Inspect (``inspect-ai`` 0.3.285): its ``openai-api`` provider (chat completions:
  a ``multiple_choice`` solver with the ``choice`` scorer, ``generate`` with ``match``,
  ``includes``, ``exact``, ``model_graded_qa``, ``use_tools`` with a forced tool and the tool
  result sent back, every GenerateConfig field it maps to chat) and its ``openai`` provider
  with ``responses_api=true`` over ``/v1/responses``. Not installed in CI: inspect-ai 0.3.285
  needs ``fsspec<=2026.6.0`` against constraints.txt's ``fsspec==2026.9.0`` (with the pins pip
  backtracks, minutes long, to 0.3.69 of early 2025).

Inspect's ``openai`` provider takes a model name it does not know for OpenAI's newest
reasoning model: it first probes reasoning summaries (``reasoning: {effort, summary}``: a 400
is taken as "not supported", once, and never retried) and then asks every turn for
``include: ["reasoning.encrypted_content"]`` with ``store: false``. Until stop 63 that
``include`` was a 400, so every sample failed and the eval stopped with no sample scored;
vLLM accepts it, and here there are no reasoning items to add it to."""

from __future__ import annotations

import httpx
import pytest

from test_server_support import MODEL, live_fixture  # noqa: F401 - the ``live`` fixture

TIMEOUT_S = 10.0

ADD_TOOL_CHAT = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {
            "x": {"type": "integer", "description": "First number."},
            "y": {"type": "integer", "description": "Second number."}},
        "required": ["x", "y"], "additionalProperties": False}, "strict": True}}
ADD_TOOL_RESPONSES = {"type": "function", "name": "add", "description": "Add two numbers.",
                      "parameters": ADD_TOOL_CHAT["function"]["parameters"], "strict": False}
MC_PROMPT = ("Answer the following multiple choice question. The entire content of your "
             "response should be of the following format: 'ANSWER: $LETTER' (without quotes) "
             "where LETTER is one of A,B,C.\n\nWhat is 1+1?\n\nA) 2\nB) 3\nC) 4")

# inspect eval --model openai-api/calexec/<model> (chat completions), as sent
INSPECT_CHAT = {
    "multiple_choice": {"model": MODEL, "messages": [{"role": "user", "content": MC_PROMPT}]},
    "generate_config": {
        "model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "hello world"}],
        "frequency_penalty": 0.1, "logprobs": True, "max_tokens": 8, "n": 2,
        "presence_penalty": 0.1, "seed": 1, "stop": ["<5"], "temperature": 0.5,
        "top_logprobs": 2, "top_p": 0.9},
    "forced_tool": {
        "model": MODEL, "messages": [{"role": "user", "content": "What is 1+2? use the add tool"}],
        "max_tokens": 64, "tool_choice": {"type": "function", "function": {"name": "add"}},
        "tools": [ADD_TOOL_CHAT]},
    "tool_result_back": {
        "model": MODEL, "messages": [
            {"role": "user", "content": "What is 1+2? use the add tool"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "call_18326595822e432a9a834bbb", "type": "function",
                "function": {"name": "add", "arguments": "{\"x\": 505, \"y\": 32}"}}]},
            {"role": "tool", "content": "537", "tool_call_id": "call_18326595822e432a9a834bbb"}],
        "max_tokens": 64, "tool_choice": "auto", "tools": [ADD_TOOL_CHAT]},
}

# inspect eval --model openai/<model> -M responses_api=true (OPENAI_BASE_URL), as sent
ENCRYPTED = {"include": ["reasoning.encrypted_content"], "store": False}
INSPECT_RESPONSES = {
    "multiple_choice": {"model": MODEL, **ENCRYPTED, "max_output_tokens": 16, "input": [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": MC_PROMPT}]}]},
    "developer_message": {"model": MODEL, **ENCRYPTED, "max_output_tokens": 16, "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "hello world"}]}]},
    "forced_tool": {"model": MODEL, **ENCRYPTED, "max_output_tokens": 64,
                    "tool_choice": {"type": "function", "name": "add"},
                    "tools": [ADD_TOOL_RESPONSES], "input": [
                        {"type": "message", "role": "user", "content": [
                            {"type": "input_text", "text": "What is 1+2? use the add tool"}]}]},
    "tool_result_back": {"model": MODEL, **ENCRYPTED, "max_output_tokens": 16,
                         "tools": [ADD_TOOL_RESPONSES], "input": [
                             {"type": "message", "role": "user", "content": [
                                 {"type": "input_text",
                                  "text": "What is 1+2? use the add tool"}]},
                             {"arguments": "{\"x\":74551712153", "call_id": "call_0c05",
                              "name": "add", "type": "function_call",
                              "id": "fc_3b894114c5ba4409a02f2925185d9225",
                              "status": "completed"},
                             {"type": "function_call_output", "call_id": "call_0c05",
                              "output": "Error parsing the following tool call arguments"}]},
}


@pytest.mark.parametrize("name", sorted(INSPECT_CHAT))
def test_inspects_chat_bodies_are_answered(live, name):
    server, _, _ = live
    body = INSPECT_CHAT[name]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == body.get("n", 1)
    if name == "forced_tool":  # inspect runs the call: it must be the named tool's
        assert choices[0]["message"]["tool_calls"][0]["function"]["name"] == "add"


@pytest.mark.parametrize("name", sorted(INSPECT_RESPONSES))
def test_inspects_responses_bodies_asking_for_encrypted_reasoning_are_answered(live, name):
    """Stop 63: each was a 400 ``include=["reasoning.encrypted_content"]: no additional output
    data is supported``: Inspect's Responses path failed every sample."""
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/responses", json=INSPECT_RESPONSES[name],
                   timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    response = r.json()
    assert response["status"] in ("completed", "incomplete")
    kinds = [item["type"] for item in response["output"]]
    assert "reasoning" not in kinds and kinds, kinds  # no reasoning item to include it in
    if name == "forced_tool":
        assert response["output"][-1]["name"] == "add"


def test_inspects_reasoning_probe_is_a_400_naming_reasoning(live):
    """Inspect probes reasoning summaries once per provider; a 4xx is cached as "not
    supported" (a 5xx or 429 would be probed again on every sample)."""
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S, json={
        "model": MODEL, "input": "Please say 'hello, world'",
        "reasoning": {"effort": "low", "summary": "auto"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "reasoning"


@pytest.mark.parametrize(("include", "param"), [
    (["message.output_text.logprobs", "reasoning.summary"], "include.1"),  # not OpenAI's
    (["reasoning.encrypted_content", "bogus"], "include.1"),
    ([{"a": 1}], "include.0"),  # not hashable: a 400, never a 500
    ([1], "include.0"),
    ("reasoning.encrypted_content", "include"),  # not a list
])
def test_an_include_that_cannot_be_honoured_is_refused_naming_it(live, include, param):
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S, json={
        "model": MODEL, "input": "x", "max_output_tokens": 1, "include": include})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert param in error["message"]


def test_every_include_asking_for_items_never_output_is_accepted(live):
    server, _, _ = live
    everything = ["reasoning.encrypted_content", "file_search_call.results",
                  "web_search_call.results", "web_search_call.action.sources",
                  "message.input_image.image_url", "computer_call_output.output.image_url",
                  "code_interpreter_call.outputs"]
    r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S, json={
        "model": MODEL, "input": "x", "max_output_tokens": 1, "include": everything,
        "stream": True})
    assert r.status_code == 200, r.text
    assert "event: response.incomplete" in r.text
