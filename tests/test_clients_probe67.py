"""Stop 67's probe with real clients (docs/traceability.md "Found at stop 67 (clients)"): the
official ``openai`` SDK with its own retries on (``max_retries=2``, as its users run it)
against a server whose only sequence id is held, and ``n`` choices of tool calls through the
SDK's ``chat.completions.stream`` helper. Both held: the tests pin them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import needs
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import MODEL, LiveServer, server_idle, started_executor, wait_for

openai = needs.module("openai", "clients")
httpx = needs.module("httpx", "server")

TIMEOUT_S = 30.0
#: the emulator's time per decode job: the held stream cannot end before the test ends it
DECODE_US = 50_000


@pytest.fixture(name="one_sequence")
def one_sequence_fixture(tmp_path) -> Iterator[tuple]:
    """``(url, service)`` of a server with one sequence id and no waiting (``max_waiting``
    0: a second request is the 429 ``kv.full`` at once), on a slow emulated device."""
    executor = started_executor(tmp_path, device_config=f"decode_us={DECODE_US}")
    try:
        app = create_app(executor, ServerConfig(max_sequences=1, max_waiting=0))
        with LiveServer(app) as server:
            yield server.url, app.state.service
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_sdk_retries_a_429_and_is_served_once_the_sequence_is_free(one_sequence, route):
    """(Not a defect: pins docs/server.md "Retries".) A request that finds no free sequence
    id is a 429 with ``Retry-After: 1`` and no ``x-should-retry``: the SDK retries it after
    the server's second and is served once the holder is gone. Every answer carries its own
    ``x-request-id``, and the SDK's ``request_id`` is the served answer's."""
    url, service = one_sequence
    plain = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                          timeout=TIMEOUT_S)
    holder = plain.completions.create(model=MODEL, prompt="hold", max_tokens=4000, stream=True)
    next(iter(holder))  # admitted: the only sequence id is its own
    answers: list = []

    def seen(response) -> None:
        answers.append(response)
        if response.status_code == 429 and len(answers) == 1:
            holder.close()  # the client leaves: the server cancels it and frees the id
            wait_for(lambda: server_idle(service), TIMEOUT_S, "the held sequence to be freed")

    http = httpx.Client(event_hooks={"response": [seen]})
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2,
                        timeout=TIMEOUT_S, http_client=http)
    if route == "completions":
        raw = sdk.completions.with_raw_response.create(model=MODEL, prompt="yo", max_tokens=2)
    else:
        raw = sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "yo"}], max_tokens=2)
    served = raw.parse()
    sdk.close()
    plain.close()
    assert [a.status_code for a in answers] == [429, 200], [a.text for a in answers]
    refused = answers[0]
    assert refused.headers["retry-after"] == "1" and "x-should-retry" not in refused.headers
    assert refused.json()["error"]["code"] == "kv.full", refused.text
    assert raw.retries_taken == 1
    ids = [a.headers["x-request-id"] for a in answers]
    assert len(set(ids)) == 2 and raw.request_id == ids[1] == served.id
    wait_for(lambda: server_idle(service), TIMEOUT_S, "the server to be idle")


TOOLS = [{"type": "function", "function": {
            "name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"]}}},
         {"type": "function", "function": {
             "name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"type": "integer"}},
                 "required": ["zone"]}}}]


def _calls(choices) -> list[tuple]:
    return [(c.index, c.finish_reason, c.message.content,
             [(t.function.name, t.function.arguments) for t in c.message.tool_calls or ()],
             [lp.token for lp in c.logprobs.content or ()]) for c in choices]


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_n_choices_of_tool_calls_through_the_stream_helper_equal_the_whole_answer(
        tmp_path, choice, parallel):
    """(Not a defect: pins what held, seed 11.) ``n`` 3 choices of sampled tool calls with
    ``logprobs``, streamed through the SDK's ``chat.completions.stream`` helper, end as the
    whole answer of the same request: each choice's calls, finish reason and logprob tokens;
    ``parallel_tool_calls: false`` gives each choice one call."""
    from test_server_support import openai_server

    tool_choice = ("required" if choice == "required"
                   else {"type": "function", "function": {"name": "get_weather"}})
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "weather in Paris?"}],
           "tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": parallel,
           "n": 3, "max_tokens": 300, "temperature": 1, "seed": 11, "logprobs": True,
           "top_logprobs": 1}
    with openai_server(tmp_path, timeout=TIMEOUT_S) as (_, sdk, _):
        whole = sdk.chat.completions.create(**ask)
        with sdk.chat.completions.stream(**ask) as stream:
            kinds = {event.type for event in stream}
            streamed = stream.get_final_completion()
    assert _calls(streamed.choices) == _calls(whole.choices)
    assert {"tool_calls.function.arguments.done", "logprobs.content.done"} <= kinds, kinds
    finish = "stop" if choice == "named" else "tool_calls"
    for c in whole.choices:
        assert c.finish_reason == finish and c.message.tool_calls, c
        if not parallel:
            assert len(c.message.tool_calls) == 1, c.message.tool_calls
