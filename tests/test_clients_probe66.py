"""Stop 66's probe with real clients: the official ``openai`` SDK (no retries) against a
loopback server on the synthetic model whose emulated decode takes 0.2 s a token, so a
request's ``timeout`` (calexec's body field) runs out while the server waits for a job
(docs/server.md, the 504 row; docs/traceability.md "Found at stop 66 (clients)")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from calexec.drivers.serving.server import ServerConfig, create_app
from needs import module
from test_server_support import MODEL, LiveServer, server_idle, started_executor, wait_for

openai = module("openai", "clients")

#: the emulator's time per decode job: a deadline mid-generation meets a wait for one
DECODE_US = 200_000


@pytest.fixture(scope="module", name="slow")
def slow_fixture(tmp_path_factory) -> Iterator[tuple]:
    """``(sdk, service)``: the SDK (timeout 30 s, no retries) of a server whose decode jobs
    take ``DECODE_US`` each."""
    executor = started_executor(tmp_path_factory.mktemp("calbin"),
                                device_config=f"decode_us={DECODE_US}")
    try:
        app = create_app(executor, ServerConfig())
        with LiveServer(app) as server:
            sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                timeout=30.0)
            yield sdk, app.state.service
            sdk.close()
    finally:
        executor.shutdown(5.0)


def _told(message: str, field: str) -> None:
    assert message.startswith("request timeout=0.5 s passed after "), message
    assert f"give a larger timeout or a smaller {field}" in message, message
    assert "the job continues" not in message, message


@pytest.mark.parametrize("how", ["chat stream", "chat", "completions stream", "responses"])
def test_a_timeout_that_ends_a_request_says_it_ended_and_what_to_change(slow, how):
    """A request whose ``timeout`` ran out while the server waited for its job was told
    "request timeout=0.5 s passed after 2 generated tokens (the body's timeout, or the
    server's --timeout; wait_until deadline passed; the job continues (state Submitted))":
    the executor's words for its wait, though the server cancels that job (the device was
    idle right after), and nothing said what to change. The message now says the request
    ended there and to give a larger ``timeout`` or a smaller maximum, named as the body
    named it (``max_completion_tokens``, ``max_output_tokens``); the job is gone."""
    sdk, service = slow
    ask = {"extra_body": {"timeout": 0.5}}
    if how == "chat stream":
        with pytest.raises(openai.APIError) as failed:
            for _ in sdk.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                    stream=True, **ask):
                pass
        _told(failed.value.message, "max_tokens")
        # the deadline meets the wait for the running step's job, or, on a loaded host, the
        # executor's admission of the next one (its code admission.deadline): the request's
        # deadline either way (stop 72: the test asked for the first alone and failed so)
        assert failed.value.code in ("wait.deadline", "admission.deadline"), failed.value.body
    elif how == "chat":
        with pytest.raises(openai.APIStatusError) as failed:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        max_completion_tokens=40, **ask)
        assert failed.value.status_code == 504
        _told(failed.value.body["message"], "max_completion_tokens")
    elif how == "completions stream":
        with pytest.raises(openai.APIError) as failed:
            for _ in sdk.completions.create(model=MODEL, prompt="hi", max_tokens=40,
                                            stream=True, **ask):
                pass
        _told(failed.value.message, "max_tokens")
    else:
        with pytest.raises(openai.APIStatusError) as failed:
            sdk.responses.create(model=MODEL, input="hi", max_output_tokens=40, **ask)
        assert failed.value.status_code == 504
        _told(failed.value.body["message"], "max_output_tokens")
    wait_for(lambda: server_idle(service), timeout=10.0, what="the timed-out job to be gone")
