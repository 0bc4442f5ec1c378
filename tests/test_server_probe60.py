"""Stop 60's server probe (docs/traceability.md "Found at stop 60 (server)"): the retries a
client's SDK makes of answers no retry changes, the transfer codings of a request, a lone
surrogate escape in a JSON body, the lifecycle's messages quoting as JSON does. Loopback
servers on the bundled emulator; every wait bounded."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from calexec.drivers.calrt.runtime import Emulator
from test_server_support import (
    MODEL,
    ServeLikeServer,
    metric_value,
    openai_server,
    send_raw,
    serve_like_fixture,  # noqa: F401 - the fixture ``serve_like``
    split_head,
    started_executor,
    wait_for,
)

TIMEOUT_S = 20.0


def _sdk(url: str, answers: list[httpx.Response]) -> tuple[openai.OpenAI, httpx.Client]:
    """The official SDK with its default retries (2), seeing every answer it gets."""
    http = httpx.Client(event_hooks={"response": [answers.append]})
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2,
                         timeout=TIMEOUT_S, http_client=http), http


def _admitted(server) -> float:
    """Completion requests the server admitted (``calexec_requests_total``, not streamed)."""
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S).text
    return metric_value(text, "calexec_requests_total", {"stream": "false"}) or 0.0


def test_the_sdk_does_not_retry_a_504_of_the_requests_own_deadline(tmp_path):
    """A request whose own ``timeout`` passed (504 ``wait.deadline``) was answered without
    ``x-should-retry``: the OpenAI SDK retries every 5xx (``max_retries``, 2 by default,
    after a back-off), so the server ran it 3 times, each with the same budget on the same
    server, and the client got the same 504 seconds later. It now says
    ``x-should-retry: false``: the server sees it once."""
    with openai_server(tmp_path, timeout=TIMEOUT_S) as (server, _, service):
        Emulator(service.executor.device).set_latency(decode_us=300_000)
        answers: list[httpx.Response] = []
        sdk, http = _sdk(server.url, answers)
        before = _admitted(server)
        with pytest.raises(openai.APIStatusError) as failed:
            sdk.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                   extra_body={"timeout": 0.2})
        http.close()
        seen = _admitted(server) - before
        Emulator(service.executor.device).set_latency()
    assert failed.value.status_code == 504, failed.value
    assert answers[0].json()["status"]["category"] == "deadline"
    assert answers[0].headers.get("x-should-retry") == "false"
    assert (len(answers), seen) == (1, 1), [(a.status_code, a.json()["error"]) for a in answers]


def test_a_504_met_while_the_model_switches_stays_retryable(tmp_path):
    """The other side of the rule: a request whose deadline passed while it waited for a
    model switch (the lifecycle Warming the new calbin's golden) may be served once the
    switch is done, so its 504 carries no ``x-should-retry``: the SDK retries it as any
    5xx."""
    with openai_server(tmp_path, timeout=TIMEOUT_S) as (server, _, service):
        executor = service.executor
        Emulator(executor.device).set_latency(decode_us=500_000)
        switched: list = []
        worker = threading.Thread(target=lambda: switched.append(
            executor.switch_model(executor.config.calbin_path)))
        worker.start()
        try:
            wait_for(lambda: executor.state != "Ready", what="the switch to begin")
            answer = httpx.post(f"{server.url}/v1/completions", timeout=TIMEOUT_S, json={
                "model": MODEL, "prompt": "hi", "max_tokens": 1, "timeout": 0.2})
            state = executor.state
        finally:
            worker.join(TIMEOUT_S)
            Emulator(executor.device).set_latency()
    assert switched and switched[0].ok, switched
    assert state != "Ready"
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["code"] == "admission.deadline"
    assert "x-should-retry" not in answer.headers


BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
CHUNKED = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)


def _posted(port: int, fields: list[bytes], payload: bytes) -> tuple[bytes, dict, dict]:
    """POST /v1/completions with the header ``fields``: status line, headers, JSON body."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"".join(field + b"\r\n" for field in fields) + b"\r\n")
    data, how = send_raw(port, head + payload, timeout=TIMEOUT_S)
    status, headers, rest = split_head(data)
    assert how == "eof", (how, data[:300])
    return status, headers, json.loads(rest[:int(headers["content-length"])])


@pytest.mark.parametrize("fields", [
    [b"Transfer-Encoding: identity", b"Transfer-Encoding: chunked"],
    [b"Transfer-Encoding: identity, chunked"],
], ids=["two-fields", "one-field"])
def test_identity_before_chunked_is_no_transfer_coding_the_server_takes(serve_like, fields):
    """``Transfer-Encoding: identity`` then ``chunked`` (two fields, or one list) was served
    200 as if ``identity`` were a coding that changes nothing: RFC 7230 dropped it, RFC 9112
    section 6.1 has no such transfer coding, and a server SHOULD answer a coding it does not
    understand 501, as this one answers ``gzip, chunked``. It now does, naming it, with
    ``x-should-retry: false`` (the SDKs retry a 5xx otherwise)."""
    status, headers, body = _posted(serve_like.port, fields + [b"Connection: close"], CHUNKED)
    assert status.startswith(b"HTTP/1.1 501"), (status, body)
    assert body["error"]["message"].startswith('transfer-encoding "identity": no transfer '
                                               'coding'), body
    assert headers["x-should-retry"] == "false"


@pytest.mark.parametrize(("fields", "payload", "said"), [
    ([b"Transfer-Encoding: gzip"], BODY, 'Transfer-Encoding "gzip": a request body\'s '
     "transfer codings must end with chunked"),
    ([b"Transfer-Encoding: identity"], BODY, 'Transfer-Encoding "identity": a request '
     "body's transfer codings must end with chunked"),
    ([b"Transfer-Encoding: chunked, gzip"], CHUNKED, 'Transfer-Encoding "chunked, gzip": a '
     "request body's transfer codings must end with chunked, given once"),
    ([b"Transfer-Encoding: chunked, chunked"], CHUNKED, "must end with chunked, given once"),
    ([b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"], CHUNKED,
     "must end with chunked, given once"),
    ([b"Transfer-Encoding: "], BODY, "Transfer-Encoding is empty"),
    ([b"Transfer-Encoding: chunked", b"Content-Length: %d" % len(CHUNKED)], CHUNKED,
     'Transfer-Encoding "chunked" with a Content-Length: the body\'s length cannot be told '
     "(RFC 9112 section 6.3)"),
    ([b"Content-Length: %d" % len(CHUNKED), b"Transfer-Encoding: chunked"], CHUNKED,
     "with a Content-Length: the body's length cannot be told (RFC 9112 section 6.3)"),
], ids=["gzip", "identity", "chunked-gzip", "chunked-twice", "two-chunked-fields", "empty",
        "te-then-cl", "cl-then-te"])
def test_a_transfer_encoding_the_body_cannot_be_framed_by_is_a_400_naming_it(
        serve_like, fields, payload, said):
    """RFC 9112 section 6.3: a request whose Transfer-Encoding does not end with chunked (or
    gives it twice, or comes with a Content-Length) has no length a server can tell, and
    gets a 400 and a closed connection. It did (the HTTP parser refuses it), but its
    message was "Invalid HTTP request received." for every such request: which field and
    which rule, the client was not told. The message now names both, the parser's words
    after them."""
    status, _, body = _posted(serve_like.port, fields, payload)
    assert status.startswith(b"HTTP/1.1 400"), (status, body)
    assert body["error"]["code"] == "request.malformed_http"
    assert said in body["error"]["message"], body
    assert "(the HTTP parser: " in body["error"]["message"]


def test_a_body_framed_by_chunked_alone_is_served(serve_like):
    """(What stays served: ``chunked`` in any case, an empty list element before it.)"""
    for field in (b"Transfer-Encoding: chunked", b"Transfer-Encoding: CHUNKED",
                  b"Transfer-Encoding: , chunked"):
        status, _, body = _posted(serve_like.port, [field, b"Connection: close"], CHUNKED)
        assert status.startswith(b"HTTP/1.1 200"), (field, body)


@pytest.mark.parametrize(("route", "body", "where", "escape"), [
    ("/v1/completions", '{"model": "M", "prompt": "a\\ud800b", "max_tokens": 1}', "prompt",
     "d800"),
    ("/v1/completions", '{"model": "M", "prompt": "x\\udc00", "max_tokens": 1}', "prompt",
     "dc00"),
    ("/v1/completions", '{"model": "M", "prompt": ["ok", "\\ud83d\\u0041"]}', "prompt.1",
     "d83d"),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": '
     '"\\udbff"}]}', "messages.0.content", "dbff"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt", "d800"),
], ids=["leading", "trailing", "in-a-list", "chat", "tokenize"])
def test_a_lone_surrogate_escape_is_refused_naming_where_and_what(
        serve_like, route, body, where, escape):
    """A ``\\ud800``-``\\udfff`` escape of a lone surrogate (no Unicode character) got the
    JSON parser's words, ``body: Invalid JSON: unexpected end of hex escape at line 1
    column 53`` (a trailing one: "lone leading surrogate"): a syntax error the client did
    not make, no field, no escape. It now names the field (``param`` too) and the escape,
    and how a character past U+FFFF is written, as the non-UTF-8 byte's message says what
    the byte is."""
    answer = httpx.post(f"{serve_like.url}{route}", timeout=TIMEOUT_S,
                        content=body.replace('"M"', json.dumps(MODEL)).encode("ascii"),
                        headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["message"].startswith(
        f"{where}: the escape \\u{escape} is a lone surrogate, no Unicode character (RFC 8259 "
        "section 8.2)"), error
    assert error["param"] == where
    assert "Invalid JSON" not in error["message"]


def test_a_surrogate_pair_and_an_escaped_backslash_are_still_taken(serve_like):
    """(A pair is one character; ``\\\\ud800``, a backslash then text, no escape at all.)"""
    for prompt in ("\\ud83d\\ude00", "\\\\ud800"):
        answer = httpx.post(f"{serve_like.url}/tokenize", timeout=TIMEOUT_S,
                            content=f'{{"prompt": "{prompt}"}}'.encode("ascii"),
                            headers={"content-type": "application/json"})
        assert answer.status_code == 200, (prompt, answer.text)


def test_a_reload_rolled_back_quotes_its_paths_as_json_and_names_the_flag(tmp_path):
    """``POST /admin/reload`` of a calbin with no pinned golden is rolled back, a 500 whose
    message is the lifecycle's: it quoted both paths as Python does
    (``'/x/unpinned.calbin' was refused (golden.unpinned: calbin '/x/unpinned.calbin' ...
    or set allow_unpinned_golden); '/x/synthetic.calbin' serves again``), what no JSON
    client writes (since stop 58 the server's own messages show values as JSON), and told
    the operator to set a config field a ``calexec serve`` user does not have. The paths
    are JSON strings now, the flag named beside the field."""
    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.synthetic import calbin as cb

    unpinned = str(tmp_path / "unpinned.calbin")
    cb.write(unpinned, cb.default_spec(seed=cb.DEFAULT_SEED ^ 0x3C))
    executor = started_executor(tmp_path)
    try:
        serving = executor.gen.calbin_path
        app = create_app(executor, ServerConfig(admin_token="probe60-admin"))
        with ServeLikeServer(app) as server:
            answer = httpx.post(f"{server.url}/admin/reload", timeout=TIMEOUT_S,
                                json={"calbin": unpinned},
                                headers={"authorization": "Bearer probe60-admin"})
        state = executor.state
    finally:
        executor.shutdown(5.0)
    assert answer.status_code == 500, answer.text
    error = answer.json()["error"]
    assert error["code"] == "recovery.rolled_back", error
    message = error["message"]
    assert message.startswith(f"{json.dumps(unpinned)} was refused (golden.unpinned: calbin "
                              f"{json.dumps(unpinned)} (sha256 "), message
    assert message.endswith(f"; {json.dumps(serving)} serves again"), message
    assert "(calexec serve: --allow-unpinned-golden)" in message
    assert "'" not in message, message
    assert state == "Ready"


@pytest.mark.parametrize(("field", "value", "said"), [
    ("top_p", 0, "top_p=0: must be a number in (0, 1]"),
    ("presence_penalty", -3, "presence_penalty=-3: must be a number in [-2, 2]"),
    ("temperature", 10 ** 40, f"temperature={10 ** 40}: must be a number in [0, 2]"),
    ("logit_bias", {"5": 101}, "logit_bias[5]=101: must be a number in [-100, 100]"),
], ids=["top_p", "penalty", "huge-int", "logit_bias"])
def test_a_refused_number_is_shown_as_the_body_wrote_it(serve_like, field, value, said):
    """The sampling parameters hold floats, and their refusal showed the converted value:
    ``top_p: 0`` was told ``top_p=0.0``, a bias of ``101`` ``101.0``, and an integer past a
    double's range (``10**400``; here a smaller one for the same path) ``Infinity`` where
    too large to convert: numbers the client never wrote. They are shown as written."""
    answer = httpx.post(f"{serve_like.url}/v1/completions", timeout=TIMEOUT_S, json={
        "model": MODEL, "prompt": "hi", "max_tokens": 1, field: value})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["message"] == said
    assert answer.json()["error"]["param"] == field


#: where each reason's line is (stop 68: the line named, tests/test_leftovers_probe68.py)
_OBS_FOLD = (" at header field line 3 (it begins with a space or tab: an obs-fold continuation "
             "of the line before, which RFC 9112 section 5.2 lets a server refuse: write the "
             "value on one line)")


@pytest.mark.parametrize(("head", "reason"), [
    (b"Content-Length: 2\r\nContent-Length: 3\r\n",
     'Duplicate Content-Length at header field line 3 ("Content-Length: ...")'),
    (b"X-A: a\r\n b\r\nContent-Length: 2\r\n",
     "Unexpected whitespace after header value" + _OBS_FOLD),
    (b"Content-Length : 2\r\n",
     'Invalid header field char at header field line 2 ("Content-Length : ...")'),
    (b"Content-Length: +2\r\n",
     'Invalid character in Content-Length at header field line 2 ("Content-Length: ...")'),
], ids=["two-content-lengths", "obs-fold", "space-before-colon", "signed-length"])
def test_a_request_the_parser_refuses_is_told_the_parsers_reason(serve_like, head, reason):
    """docs/server.md said the 400 ``request.malformed_http`` carries the parser's message;
    it carried uvicorn's ``Invalid HTTP request received.`` for every refusal, whichever rule
    the request broke (two Content-Lengths, an obs-fold line, a space before a colon, a
    signed length: RFC 9112 sections 5.1, 5.2, 6.3). The parser's reason now follows."""
    raw = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}"
    data, how = send_raw(serve_like.port, raw, timeout=TIMEOUT_S)
    status, headers, rest = split_head(data)
    assert status.startswith(b"HTTP/1.1 400") and how == "eof", (how, data[:300])
    error = json.loads(rest[:int(headers["content-length"])])["error"]
    assert error["code"] == "request.malformed_http"
    assert error["message"] == f"Invalid HTTP request received: {reason}.", error
