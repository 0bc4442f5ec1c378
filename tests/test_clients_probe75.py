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

from openai.types import Model  # noqa: E402 - after the extra's check

from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_clients_probe74 import check_chat, check_completions, check_responses  # noqa: E402

TIMEOUT_S = 30.0
BODIES = json.loads((Path(__file__).parent / "data" / "clients75" / "bodies.json")
                    .read_text(encoding="utf-8"))
LIBRARIES = sorted(k for k in BODIES if not k.startswith("_"))
CASES = [(library, i) for library in LIBRARIES for i in range(len(BODIES[library]))]
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


@pytest.fixture(scope="module", name="plain")
def plain_fixture(tmp_path_factory):
    """A loopback server of ``ServerConfig`` defaults."""
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    try:
        with LiveServer(create_app(executor, ServerConfig())) as server:
            yield server
    finally:
        executor.shutdown(5.0)


def test_an_item_reference_is_refused_saying_how_to_send_the_item_itself(plain):
    """The AI SDK's ``openai(model)`` (``@ai-sdk/openai``'s default, the Responses API) sends an
    assistant turn of an earlier answer (``messages.push(...result.response.messages)``, a
    ``useChat`` history) as ``{"type": "item_reference", "id": "msg_..."}`` while its ``store``
    option is true, its default, whatever the server answered (``store: false``). Nothing is
    stored here, so the reference stays a 400 naming ``input.N.type``; until stop 75 its
    message said only that references are not supported, and the user had to find out why
    their client sent one: it now names the item's id and the setting that sends the item
    itself (``store: false``; the AI SDK: ``providerOptions.openai.store``)."""
    row = next(r for r in BODIES["vercel_ai"] if r["call"] == "more.resp.store_true_multiturn"
               and r["status"] == 400)
    r = httpx.post(f"{plain.url}{row['path']}", content=json.dumps(row["body"]),
                   headers=row["headers"], timeout=TIMEOUT_S)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input.1.type"
    reference = row["body"]["input"][1]["id"]
    assert f'id "{reference}"' in error["message"] or json.dumps(reference) in error["message"]
    assert "store: false" in error["message"] and "providerOptions.openai.store" in \
        error["message"]
    # the same conversation with store: false, as the AI SDK then sends it, is answered
    sent = next(r for r in BODIES["vercel_ai"] if r["call"] == "more.resp.store_false_multiturn"
                and len(r["body"]["input"]) == 3)
    assert sent["body"]["input"][1]["role"] == "assistant"
    r = httpx.post(f"{plain.url}{sent['path']}", content=json.dumps(sent["body"]),
                   headers=sent["headers"], timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("library", "i"), CASES)
def test_each_js_clients_recorded_request_is_answered_as_it_reads_it(plain, library, i):
    """(Not a defect: pins what held.) Every request the JS libraries sent, with the headers
    they sent, is answered with the status it got when recorded: every answer and chunk valid
    as the SDK's strict types (the checks of tests/test_clients_probe74.py: one id per answer,
    ``created`` now, usage adding up, each choice ended once, ``[DONE]`` last, Responses
    events numbered from 0 ending in one ``response.completed`` or ``response.incomplete``),
    a refusal OpenAI-shaped and naming the field the library's error reports."""
    row = BODIES[library][i]
    content = None if row["body"] is None else json.dumps(row["body"])
    r = httpx.request(row["method"], f"{plain.url}{row['path']}", content=content,
                      headers=row["headers"], timeout=TIMEOUT_S)
    assert r.status_code == row["status"], r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["param"] == row["param"] and error["type"] == "invalid_request_error"
        assert error["message"] and r.headers["x-request-id"]
        return
    if row["method"] == "GET":
        listed = r.json()
        models = listed["data"] if "data" in listed else [listed]
        assert models and all(Model.model_validate(m, strict=True).object == "model"
                              for m in models)
        return
    {"/v1/chat/completions": check_chat, "/v1/completions": check_completions,
     "/v1/responses": check_responses}[row["path"]](row["body"], r)


def test_the_recorded_js_requests_cover_every_library_and_what_they_send():
    """The data holds what the probe saw each library send: a re-record that lost a library,
    a route or a field fails here, not silently."""
    assert LIBRARIES == ["langchain_js", "openai_js", "vercel_ai"]
    rows = [row for library in LIBRARIES for row in BODIES[library]]
    agents = {row["headers"].get("user-agent", "").split("/")[0] for row in rows}
    assert {"OpenAI", "ai", "ai-sdk", "langchainjs-openai"} <= agents
    sent = {key for row in rows for key in (row["body"] or {})}
    assert {"max_tokens", "max_output_tokens", "response_format", "text", "tools",
            "tool_choice", "stream_options", "instructions", "n", "logprobs", "top_logprobs",
            "stop", "seed", "store", "metadata", "user", "parallel_tool_calls",
            "include"} <= sent
    paths = {(row["method"], row["path"]) for row in rows}
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
            ("POST", "/v1/responses"), ("GET", "/v1/models")} <= paths
    items = {item.get("type") for row in rows if row["path"] == "/v1/responses"
             and isinstance(row["body"]["input"], list) for item in row["body"]["input"]}
    assert {"function_call", "function_call_output", "item_reference", "message"} <= items
    streamed = [row for row in rows if (row["body"] or {}).get("stream")]
    assert {row["path"] for row in streamed} == {"/v1/chat/completions", "/v1/completions",
                                                 "/v1/responses"}


#: paths of the openai npm package 7.60's resources (``client.beta.agents``, ``skills``,
#: ``beta.chatkit``, ``webhooks``, ``admin.organization``, ``safety``, ``decisions``,
#: ``live.sessions``, ``contentProvenanceChecks``) that no earlier SDK had, and what the 404
#: of each says after ``no such route: ``
NEW_IN_SDK7 = {"/v1/agents": "stores nothing", "/v1/skills/sk_1": "stores nothing",
               "/v1/chatkit/sessions": "stores nothing", "/v1/chatkit/threads": "stores nothing",
               "/v1/webhook_endpoints": "no webhooks", "/v1/webhook_event_types": "no webhooks",
               "/v1/organization/costs": "/admin", "/v1/organization/admin_api_keys": "/admin",
               "/v1/safety/alerts": "/admin", "/v1/safety/cases/c_1": "/admin",
               "/v1/decisions": "response_format", "/v1/live/sessions": "text only",
               "/v1/content_provenance_checks": "text only"}


@pytest.mark.parametrize("path", sorted(NEW_IN_SDK7))
def test_an_endpoint_new_in_the_js_sdk_says_why_it_is_not_served(plain, path):
    """The openai npm package 7.60 calls endpoints no earlier SDK had; each was a 404 ``no
    such route`` alone until stop 75, which told a user of ``client.skills.list()`` or
    ``client.webhooks...`` nothing of whether the base URL or the server was wrong, as the
    stored objects' and audio routes were until stop 64. Each now says why (same code and
    shape); a path of no OpenAI endpoint is still ``no such route`` alone."""
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{plain.url}{path}", json={}, timeout=TIMEOUT_S)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert error["code"] == "not_found" and error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{method} {path}: no such route: ")
        assert NEW_IN_SDK7[path] in error["message"], error["message"]
    r = httpx.get(f"{plain.url}/v1/agentsx", timeout=TIMEOUT_S)
    assert r.json()["error"]["message"] == \
        "GET /v1/agentsx: no such route (docs/server.md lists them)"
