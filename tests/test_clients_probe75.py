"""Stop 75's probe with JavaScript clients (docs/traceability.md "Found at stop 75 (clients)"):
the ``openai`` npm package (chat, streams with usage, tools, ``zodResponseFormat`` and
``chat.completions.parse``, completions, Responses with ``parse`` and streams, models, errors,
retries, ``AbortController``), the Vercel AI SDK (``ai`` with ``@ai-sdk/openai``'s Responses
default and ``.chat()``, ``@ai-sdk/openai-compatible``: ``generateText``, ``streamText``,
``generateObject``, ``streamObject``, tools over steps) and ``@langchain/openai``'s
``ChatOpenAI`` (chat and ``useResponsesApi``: invoke, stream, ``bindTools``,
``withStructuredOutput``).

The requests, as each library sent them, are ``tests/data/clients75/bodies.json`` (which calls
sent them: its ``_about``; the scripts that drove the libraries, ``tests/data/clients75/node/``,
are run by hand, never by CI); these tests replay them over httpx and validate every answer
and chunk with the pinned ``openai`` SDK's pydantic types in strict mode, as
tests/test_clients_probe74.py does (its checks, imported)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import needs
from test_server_support import MODEL, LiveServer, started_executor

httpx = needs.module("httpx", "server")
openai = needs.module("openai", "server")

from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402

TIMEOUT_S = 30.0
ORIGIN = "http://app.example"
#: the response headers a browser lets a page's script read without the server exposing them
#: (the Fetch standard's CORS-safelisted response header names)
SAFELISTED = frozenset({"cache-control", "content-language", "content-length", "content-type",
                        "expires", "last-modified", "pragma"})


class BrowserTransport(httpx.HTTPTransport):
    """What a browser page's script gets from ``fetch``: the page's ``Origin`` sent, and of
    the answer's headers only the safelisted ones and those ``Access-Control-Expose-Headers``
    names; every request sent counted in ``sent``."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def handle_request(self, request):
        request.headers["origin"] = ORIGIN
        self.sent += 1
        response = super().handle_request(request)
        exposed = {h.strip().lower() for h in
                   response.headers.get("access-control-expose-headers", "").split(",")}
        visible = [(k, v) for k, v in response.headers.multi_items()
                   if k.lower() in SAFELISTED or k.lower() in exposed]
        return httpx.Response(response.status_code, headers=visible, stream=response.stream,
                              extensions=response.extensions)


@pytest.fixture(scope="module", name="cors")
def cors_fixture(tmp_path_factory):
    """A loopback server admitting pages of ``ORIGIN`` (``--cors-origin``)."""
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    try:
        with LiveServer(create_app(executor, ServerConfig(cors_origins=(ORIGIN,)))) as server:
            yield server
    finally:
        executor.shutdown(5.0)


def test_a_browser_page_s_sdk_sees_that_an_answer_is_not_to_be_retried(cors):
    """The openai JS SDK in a page (``dangerouslyAllowBrowser``) reads ``x-should-retry`` as
    every OpenAI SDK does, but a browser shows it only headers the server exposes: until stop
    75 only ``retry-after`` and ``x-request-id`` were, so the page's SDK retried (twice, after
    a back-off) a 504 of the request's own deadline, an operator's 409 cancel, a 500 no retry
    fixes, each answered ``x-should-retry: false``. Shown here with the Python SDK over a
    transport that lets through what a browser lets a script read (the JS SDK over such a
    fetch, tests/data/clients75/node/cors.mjs, did the same)."""
    transport = BrowserTransport()
    client = openai.OpenAI(base_url=f"{cors.url}/v1", api_key="unused", max_retries=2,
                           http_client=httpx.Client(transport=transport, timeout=TIMEOUT_S))
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, extra_body={"timeout": 1e-6})
    assert caught.value.status_code == 504
    assert caught.value.response.headers.get("x-should-retry") == "false"
    assert transport.sent == 1
    # the request id still reaches the page's script
    answer = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.headers["x-request-id"] == json.loads(answer.text)["id"]
