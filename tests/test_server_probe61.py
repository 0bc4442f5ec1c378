"""Stop 61's server probe (docs/traceability.md "Found at stop 61 (server)"): the HTTP
version of a request line, an empty list element in a Transfer-Encoding. Loopback servers on
the bundled emulator; every wait bounded."""

from __future__ import annotations

import json

import pytest

from test_server_support import (
    MODEL,
    ServeLikeServer,
    responses,
    send_raw,
    serve_like_fixture,  # noqa: F401 - the fixture ``serve_like``
    started_executor,
)

TIMEOUT_S = 20.0


def _answers(port: int, raw: bytes) -> tuple[list, str]:
    data, how = send_raw(port, raw, timeout=TIMEOUT_S)
    return responses(data), how


@pytest.mark.parametrize(("line", "named"), [
    (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", "HTTP/2.0 is not supported"),
    (b"GET /health HTTP/3.0\r\nHost: x\r\n\r\n", "HTTP/3.0 is not supported"),
    (b"GET /health HTTP/0.9\r\nHost: x\r\n\r\n", "HTTP/0.9 is not supported"),
    (b"GET /health\r\n\r\n", "HTTP/0.9 is not supported"),
    (b"POST /v1/completions HTTP/9.9\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
     "HTTP/9.9 is not supported"),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "the HTTP/2 connection preface"),
], ids=["2.0", "3.0", "0.9", "0.9-no-version", "9.9-with-body", "h2-preface"])
def test_an_http_version_whose_major_is_not_1_is_a_505_naming_it(serve_like, line, named):
    """RFC 9112 section 2.3, RFC 9110 section 15.6.6: a request line whose HTTP version has
    a major version other than 1 is not an HTTP/1 request. ``HTTP/2.0`` and ``HTTP/0.9``
    (and a request line with no version) were served as HTTP/1.1 (200), ``HTTP/3.0`` and
    HTTP/2's connection preface answered 400 ``Invalid HTTP version`` / ``Pause on
    PRI/Upgrade``; every one is now 505 in the OpenAI error shape, naming the version and
    what the server speaks, ``x-should-retry: false`` (the SDKs retry a 5xx otherwise) and
    the connection closed."""
    answers, how = _answers(serve_like.port, line)
    assert how == "eof" and len(answers) == 1, (how, answers)
    status, headers, body = answers[0]
    assert status == b"HTTP/1.1 505 HTTP Version Not Supported", (status, body)
    error = json.loads(body)["error"]
    assert error["code"] == "request.http_version_not_supported", error
    assert error["message"].startswith(named), error
    assert "this server speaks HTTP/1.1 and HTTP/1.0" in error["message"], error
    assert json.loads(body)["status"]["http_status"] == 505
    assert headers["connection"] == "close"
    assert headers["x-should-retry"] == "false"
    assert headers.get("x-request-id")


def test_a_505_pipelined_behind_a_request_is_written_after_its_answer(serve_like):
    """(The refusal keeps the connection's order: the good request before it is answered
    first, RFC 9112 section 9.3.2.)"""
    answers, how = _answers(serve_like.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                                             b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n")
    assert how == "eof", (how, answers)
    assert [status.split(b" ")[1] for status, _, _ in answers] == [b"200", b"505"], answers


def test_http_1_2_is_served_as_http_1_1(serve_like):
    """RFC 9112 section 2.3: a recipient SHOULD process a higher minor version of a major
    version it implements as the highest minor it conforms to: ``HTTP/1.2`` was a 400
    ``Invalid HTTP version``; it is served as HTTP/1.1 now, kept alive (two pipelined
    requests answered on one connection) and, like HTTP/1.1, refused without a Host."""
    payload = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    answers, how = _answers(serve_like.port, (
        b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n"
        b"POST /v1/completions HTTP/1.9\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)))
    assert how == "eof", (how, answers)
    assert [status for status, _, _ in answers] == [b"HTTP/1.1 200 OK"] * 2, answers
    assert json.loads(answers[1][2])["choices"][0]["finish_reason"] == "length"
    answers, how = _answers(serve_like.port, b"GET /health HTTP/1.2\r\n\r\n")
    assert answers[0][0].startswith(b"HTTP/1.1 400"), answers
    assert "no Host header" in json.loads(answers[0][2])["error"]["message"]


@pytest.mark.parametrize("value", [b"chunked ,", b"chunked,", b"chunked,,", b"CHUNKED , "])
def test_an_empty_list_element_after_chunked_is_a_400_naming_the_field_and_why(
        serve_like, value):
    """RFC 9110 section 5.6.1 says a recipient ignores empty list elements, so
    ``Transfer-Encoding: chunked ,`` is ``chunked``; the HTTP parser (llhttp, which this
    server cannot change) refuses it in a request, inside the field's value, before it
    delivers the field: the 400 said "a request body's transfer codings must end with
    chunked, given once", naming no value and a rule the field does not break. It now
    names the value and says what the parser refuses."""
    payload = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    answers, how = _answers(serve_like.port, (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: %s\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (value, len(payload), payload)))
    assert how == "eof" and len(answers) == 1, (how, answers)
    status, _, body = answers[0]
    assert status.startswith(b"HTTP/1.1 400"), (status, body)
    message = json.loads(body)["error"]["message"]
    shown = json.dumps(value.decode().strip())
    assert message.startswith(f"Transfer-Encoding {shown}: an empty list element after "
                              "chunked, which RFC 9110 section 5.6.1 says a recipient "
                              "ignores"), message


@pytest.mark.parametrize(("path", "content_type"), [
    ("/v1/completions", "application/vnd.api+json"),
    ("/v1/completions", "Application/Merge-Patch+JSON; charset=utf-8"),
    ("/tokenize", "application/vnd.example.v2+json"),
])
def test_a_json_suffixed_content_type_is_read_as_json(serve_like, path, content_type):
    """RFC 6839 section 3.1: an ``application/...+json`` media type is JSON's syntax, and
    FastAPI (so vLLM's server) reads such a body as JSON; this server answered it 415
    ``the body must be JSON (application/json)``. It is read as JSON now (``text/json``,
    ``application/x-ndjson`` stay refused)."""
    import httpx

    payload = {"model": MODEL, "prompt": "hi"} | (
        {"max_tokens": 1} if path == "/v1/completions" else {})
    answer = httpx.post(f"{serve_like.url}{path}", content=json.dumps(payload).encode(),
                        headers={"content-type": content_type}, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text[:300]
    for refused in ("text/json", "application/x-ndjson", "application/+json"):
        answer = httpx.post(f"{serve_like.url}{path}", content=json.dumps(payload).encode(),
                            headers={"content-type": refused}, timeout=TIMEOUT_S)
        assert answer.status_code == 415, (refused, answer.text[:300])


@pytest.mark.parametrize(("written", "said"), [
    ("1" + "0" * 500, "timeout=" + "1" + "0" * 79 + " > max_timeout_s=600"),
    ("1e400", "timeout=Infinity > max_timeout_s=600"),
    ("600.5", "timeout=600.5 > max_timeout_s=600"),
], ids=["500-digits", "past-a-double", "just-over"])
def test_a_timeout_over_the_servers_bound_is_echoed_as_json_and_cut(serve_like, written, said):
    """A body's ``timeout`` over ``max_timeout_s`` was echoed as Python prints it: an
    integer of 500 digits whole (a 531-character message, where docs/server.md says every
    echoed value is cut to 80 characters), ``1e400`` as ``inf`` (every other refused
    number past a double's range reads ``Infinity``), the bound as ``600.0``. Now the
    value is written as JSON, cut to 80 characters."""
    import httpx

    raw = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 1, "timeout": {written}}}'.encode()
    answer = httpx.post(f"{serve_like.url}/v1/completions", content=raw,
                        headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
    error = answer.json()["error"]
    assert (answer.status_code, error["param"]) == (400, "timeout"), error
    assert error["message"] == said, error


HUGE = "1" + "0" * 500  # an integer JSON has no bound for, 501 digits
CUT = "1" + "0" * 79  # as an echo shows it: cut to 80 characters
CHAT = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(("path", "fields", "said"), [
    ("/v1/completions", f'"prompt": "hi", "max_tokens": 2, "n": -{HUGE}', f"n=-{CUT[:79]}"),
    ("/v1/completions", f'"prompt": "hi", "max_tokens": 2, "n": {HUGE}', f"n={CUT}: 1 prompt"),
    ("/v1/completions", f'"prompt": "hi", "max_tokens": 2, "min_tokens": {HUGE}',
     f"min_tokens={CUT}: must be <= max_tokens=2"),
    ("/v1/completions", f'"prompt": "hi", "max_tokens": 2, "prompt_logprobs": {HUGE}',
     f"prompt_logprobs={CUT}: must be in [0, 20]"),
    ("/v1/completions", f'"prompt": [{HUGE}], "max_tokens": 2',
     f"prompt[0]={CUT} outside the vocabulary"),
    ("/v1/completions", f'"prompt": "hi", "max_tokens": 2, "stop_token_ids": [{HUGE}]',
     f"stop_token_ids[0]={CUT} outside the vocabulary"),
    ("/v1/completions", f'"prompt": "hi", "max_tokens": {HUGE}',
     f"you requested {CUT} tokens (2 in the prompt, max_tokens={CUT} for the completion)"),
    ("/v1/chat/completions", f'{CHAT}, "logprobs": true, "top_logprobs": {HUGE}',
     f"top_logprobs={CUT}: must be in [0, 20]"),
    ("/v1/chat/completions", f'{CHAT}, "max_tokens": 2, "max_completion_tokens": {HUGE}',
     f"max_completion_tokens={CUT} and max_tokens=2 differ"),
], ids=["n-negative", "n-over-max-choices", "min-tokens", "prompt-logprobs", "prompt-id",
        "stop-token-id", "max-tokens-over-context", "top-logprobs", "max-completion-tokens"])
def test_an_integer_of_500_digits_is_echoed_cut_to_80_characters(serve_like, path, fields,
                                                                 said):
    """docs/server.md: a value echoed in a message is cut to 80 characters, so an error
    body stays small whatever the request sent. An integer of 501 digits (JSON has no bound)
    was echoed whole by the refusals of ``n``, ``min_tokens``, ``prompt_logprobs``,
    ``top_logprobs``, ``max_completion_tokens``, a prompt or stop token id outside the
    vocabulary and the context-length message (twice there: 1,176 characters); each is cut
    now."""
    import httpx

    raw = f'{{"model": "{MODEL}", {fields}}}'.encode()
    answer = httpx.post(f"{serve_like.url}{path}", content=raw,
                        headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
    error = answer.json()["error"]
    assert answer.status_code == 400, error
    assert said in error["message"], error
    assert "0" * 80 not in error["message"], len(error["message"])


DEEP_OBJECT = '{"a": ' * 300 + "1" + "}" * 300  # valid JSON, 300 levels


@pytest.mark.parametrize(("path", "raw"), [
    ("/v1/chat/completions", f'{{"model": "{MODEL}", {CHAT}, "metadata": {DEEP_OBJECT}}}'),
    ("/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "logit_bias": {DEEP_OBJECT}}}'),
    ("/tokenize", f'{{"model": "{MODEL}", "prompt": "hi", "x": {DEEP_OBJECT}}}'),
    ("/admin/reload", '{"calbin": ' + "[" * 5000 + "]" * 5000 + "}"),
], ids=["chat", "completions", "tokenize", "admin-reload"])
def test_valid_json_nested_past_the_parsers_depth_is_not_called_invalid(tmp_path_factory,
                                                                        path, raw):
    """RFC 8259 section 9 lets a parser bound the nesting; the body is valid JSON all the
    same. Nested past the parser's depth it was refused ``body: Invalid JSON: recursion
    limit exceeded at line 1 column 1106`` (``/admin/reload``: ``body: not valid JSON
    (nested too deeply)``), a syntax error the client did not make. The 400 now says the
    body is nested deeper than the parser reads (since stop 64 claiming no validity: the
    parser reads no further, tests/test_http_probe64.py)."""
    import httpx

    from calexec.drivers.serving.server import ServerConfig, create_app

    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    try:
        with ServeLikeServer(create_app(executor, ServerConfig(admin_token="t0ken"))) as server:
            answer = httpx.post(f"{server.url}{path}", content=raw.encode(), timeout=TIMEOUT_S,
                                headers={"content-type": "application/json",
                                         "authorization": "Bearer t0ken"})
    finally:
        executor.shutdown(5.0)
    error = answer.json()["error"]
    assert (answer.status_code, error["param"]) == (400, None), error
    assert error["message"].startswith("body: nested deeper than the server's JSON parser "
                                       "reads"), error
    assert "the server reads no deeper" in error["message"] \
        and "Invalid JSON" not in error["message"]


@pytest.mark.parametrize(("fields", "said"), [
    ([b"Content-Encoding: identity", b"Content-Encoding: gzip"],
     'content-encoding "gzip": not supported'),
    ([b"Content-Type: application/json", b"Content-Type: text/plain"],
     'content-type "text/plain": the body must be JSON'),
], ids=["encoding-in-a-second-field", "type-in-a-second-field"])
@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_second_field_line_is_judged_as_the_first(serve_like, path, fields, said):
    """Only the first ``Content-Encoding`` and ``Content-Type`` field was looked at:
    ``identity`` then ``gzip`` in two fields (one list, RFC 9110 section 5.3: the body is
    gzip) was read as an uncompressed body, and a JSON type then ``text/plain`` as JSON,
    where either in one field is a 415. Every field line is judged now."""
    payload = json.dumps({"model": MODEL, "prompt": "hi"} | (
        {"max_tokens": 1} if path == "/v1/completions" else {})).encode()
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" % path.encode()
    if not any(field.startswith(b"Content-Type") for field in fields):
        head += b"Content-Type: application/json\r\n"
    head += b"".join(field + b"\r\n" for field in fields)
    answers, how = _answers(serve_like.port,
                            head + b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    assert how == "eof" and len(answers) == 1, (how, answers)
    status, _, body = answers[0]
    assert status.startswith(b"HTTP/1.1 415"), (status, body)
    assert json.loads(body)["error"]["message"].startswith(said), body
