"""Stop 58's probe with real clients (the official ``openai`` SDK) against a loopback server on
the synthetic model: what a client reading vLLM's or OpenAI's answer met, each pinned here
(docs/traceability.md "Found at stop 58 (clients)"). Client timeout 10 s, no retries."""

from __future__ import annotations

import httpx
import openai
import pytest

import needs
from calexec.drivers.calrt.runtime import Emulator, Fault, FaultMode
from calexec.drivers.serving import grammar
from test_server_support import (
    MODEL,
    openai_server,
    sdk_client_fixture,  # noqa: F401 - the fixture ``client``
    streamed_chat,
)

TIMEOUT_S = 10.0

TOOL = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "hi"}]
#: the call's opening as the grammar writes it, one token a byte (the byte-level tokenizer)
OPENING = '<tool_call>\n{"name":"get","arguments":'


@pytest.mark.parametrize("cut", [12, 16, len(OPENING) - 1])
def test_a_tool_call_cut_in_its_opening_is_no_content_whole_as_streamed(
        client: openai.OpenAI, cut):
    """``max_tokens`` cut a ``required`` call inside its opening
    ``<tool_call>\\n{"name":"get","arguments":``, the grammar's markup: the stream sent no
    content and no call (docs/server.md: "a ``<tool_call>`` opening cut short is no content",
    "whole or streamed alike"), while the whole answer gave the markup itself as the
    message's content (``'<tool_call>\\n{"na'``), text no client asked for and that the
    ``required`` tool choice promises is not there. Both now answer content null, no call,
    ``finish_reason: length``. (A named tool's output has no opening: its arguments alone,
    the next test.)"""
    needs.module("llguidance", "server")
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": [TOOL], "tool_choice": "required",
              "max_tokens": cut, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.tool_calls is None
    assert whole.message.content is None, whole.message.content
    assert streamed_chat(client, **kwargs) == (None, [], "length")


@pytest.mark.parametrize(("text", "content"), [
    ('<tool_call>\n{"na', None),
    ('<tool_call>\n{"name":"get",', None),
    ('so <tool_call>\n{"name":"get","argu', "so "),
])
def test_an_auto_answer_cut_in_its_first_call_s_opening_parses_as_it_streams(text, content):
    """The same with ``tool_choice: auto``, where text may come first: the whole answer's
    parse (``grammar.parse_tool_calls``) kept the opening of the first call as content when
    ``max_tokens`` cut it before the call was named, while the stream (``ToolCallStream``)
    dropped it; an opening of a later call was already dropped by both."""
    stream = grammar.ToolCallStream()
    deltas = stream.feed(text, final=True)
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    assert stream.cut and stream.calls == 0
    assert grammar.parse_tool_calls(text) == (content, [])


@pytest.mark.parametrize(("tool_choice", "markup"), [
    ("required", len(OPENING)),
    ({"type": "function", "function": {"name": "get"}}, 0)],  # (the arguments alone)
    ids=["required", "named"])
@pytest.mark.parametrize("into", [1, 3, 5])
def test_a_forced_call_cut_in_its_arguments_is_the_call_whole_as_streamed(
        client: openai.OpenAI, tool_choice, markup, into):
    """``max_tokens`` cut a forced call (``required``, a named tool: the grammar writes the
    call, the model only its arguments) ``into`` tokens into its arguments: the stream sent
    the call with its arguments as generated (``{"x``), as OpenAI streams a cut call and as
    vLLM answers a named tool's cut arguments whole or streamed, while the whole answer gave
    no call and the grammar's markup as the message's content
    (``'<tool_call>\\n{"name":"get","arguments":{"x'``): langchain's
    ``with_structured_output(method="function_calling")`` and ``bind_tools`` read a call from
    ``stream`` and none, with markup as text, from ``invoke``. The whole answer now has the
    call as streamed, content null, ``finish_reason: length``."""
    needs.module("llguidance", "server")
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": [TOOL], "tool_choice": tool_choice,
              "max_tokens": markup + into, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = streamed_chat(client, **kwargs)
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert (whole.message.content, calls, whole.finish_reason) == streamed
    assert whole.message.content is None and whole.finish_reason == "length"
    assert len(calls) == 1 and calls[0][0] == "get", calls
    assert calls[0][1].startswith("{") and len(calls[0][1]) == into, calls


@pytest.mark.parametrize(("rc", "category", "retried"), [
    (27, "programming", False),  # UNSUPPORTED on a mandatory path: a bug or configuration
    (8, "compatibility", False),  # DRIVER_INCOMPATIBLE: "needs a manual fix"
    (17, "transient", True),  # busy: a retry may be served
])
def test_the_sdk_does_not_retry_a_failure_no_retry_can_fix(tmp_path, rc, category, retried):
    """The SDK retries every 5xx (``max_retries``, 2 by default, after a back-off) unless the
    answer says ``x-should-retry: false``. A submit failing with a PROGRAMMING or
    COMPATIBILITY CalRT code, which contracts/errors.py's table says no retry fixes ("a
    calexec bug or configuration error", "needs a manual fix"), was a plain 500: the SDK ran
    the request 3 times, each prefill failing again (a COMPATIBILITY fault had failed the
    lifecycle: the retries met 503s), and its caller waited the back-offs for the same
    error. Those 500s now say ``x-should-retry: false``: one try, the first error; a
    TRANSIENT failure (503 with Retry-After) is still retried."""
    with openai_server(tmp_path, timeout=TIMEOUT_S) as (server, _, service):
        answers: list[httpx.Response] = []
        http = httpx.Client(event_hooks={"response": [answers.append]})
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=2,
                            timeout=TIMEOUT_S, http_client=http)
        Emulator(service.executor.device).set_fault(Fault.SUBMIT_RC, FaultMode.ALWAYS, 1,
                                                    rc=rc)
        with pytest.raises(openai.APIStatusError) as failed:
            sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        http.close()
    first = answers[0]
    assert first.json()["status"]["category"] == category, first.json()
    if retried:
        assert first.status_code == 503 and "x-should-retry" not in first.headers
        assert len(answers) == 3
    else:
        assert first.status_code == 500 and first.headers["x-should-retry"] == "false"
        assert len(answers) == 1, [(a.status_code, a.json()["error"]) for a in answers]
        assert failed.value.status_code == 500
