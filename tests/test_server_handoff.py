"""Issue 16, mid-stream failover: the reference server continues a generation another replica
started (drivers/serving/handoff.py), and what the client sees is an uninterrupted run.

No Ray: the real server app on the bundled emulator, reached as a Ray replica reaches it
(``serve_relayed``), behind the real fleet ingress (drivers/fleet/ingress.py) whose first
call is cut after k tokens (the replica "dies"); the ingress continues on the same app (a
"sibling": its KV sequence is fresh, so everything is re-prefilled). The client's events
must equal an uncut run's, id and created included.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
from fastapi.testclient import TestClient  # noqa: E402

from calexec.drivers.fleet.edge import serve_relayed  # noqa: E402
from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress  # noqa: E402
from calexec.drivers.serving.byte_tokenizer import BYTE_OFFSET, ByteTokenizer  # noqa: E402
from calexec.drivers.serving.handoff import PROGRESS_TYPE  # noqa: E402
from calexec.drivers.serving.openai_api import TextOutput  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_server_support import started_executor  # noqa: E402

PROMPT = [5, 6, 7]
N = 8
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SAMPLING = {"greedy": {}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 4242},
            "unseeded": {"temperature": 1.0}}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("handoff"))
    try:
        yield create_app(executor, ServerConfig())
    finally:
        executor.shutdown(5.0)


class Died(RuntimeError):
    """The cut: the first replica's process "died"."""


async def cut_after(stream, k: int):
    """``stream`` until just before the (k+1)-th token's progress, or before the tail once k
    tokens went out; then the replica dies."""
    n = 0
    try:
        async for message in stream:
            token = message["type"] == PROGRESS_TYPE and "tokens" in message
            final = (message["type"] == PROGRESS_TYPE and "final" in message) or (
                message["type"] == "http.response.body" and not message.get("more_body"))
            if n == k and (token or final):
                raise Died(f"replica died after {k} tokens")
            n += token
            yield message
    finally:
        await stream.aclose()


async def drain_after(stream, service, k: int):
    """``stream``, its replica starting a drain once k tokens were announced (at admission
    for a whole answer); the drain ends with the hand-off (the same app is the sibling)."""
    n = 0
    try:
        async for message in stream:
            if message["type"] == PROGRESS_TYPE:
                n += "tokens" in message
                if n == k or (k == 0 and "seed" in message):
                    service.draining = True
                if "handoff" in message:
                    service.draining = False
            yield message
    finally:
        service.draining = False
        await stream.aclose()


def through_ingress(app, path: str, body: dict, cut: int | None = None, drain: bool = False):
    """(client bytes, response start, the requests the ingress sent) of ``body`` through the
    ingress to ``app``; the first call is cut after ``cut`` tokens (or, with ``drain``, its
    replica drains then)."""
    calls: list[dict] = []

    def call(request):
        calls.append(request)
        first = cut is not None and len(calls) == 1
        if drain and first:
            return drain_after(serve_relayed(app, request, handoff_ok=lambda: True),
                               app.state.service, cut)
        stream = serve_relayed(app, request)
        return cut_after(stream, cut) if first else stream

    ingress = FleetIngress(call, FailoverSettings(backoff_s=0.001))
    messages: list[dict] = []

    async def go():
        scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "http_version": "1.1"}
        given = asyncio.Event()
        payload = json.dumps(body).encode()

        async def receive():
            if not given.is_set():
                given.set()
                return {"type": "http.request", "body": payload, "more_body": False}
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            assert message["type"].startswith("http.")  # no progress message reaches it
            messages.append(message)
        await asyncio.wait_for(ingress(scope, receive, send), timeout=60)
    asyncio.run(go())
    starts = [m for m in messages if m["type"] == "http.response.start"]
    assert len(starts) == 1
    content = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    if cut is not None:
        assert len(calls) == 2
        assert ingress.failovers == {"drained" if drain else "replica_died": 1}
    return content, starts[0], calls


def events(content: bytes) -> list:
    lines = [line for line in content.decode().split("\n\n") if line]
    assert lines[-1] == "data: [DONE]" and content.count(b"[DONE]") == 1
    return [json.loads(line[6:]) for line in lines[:-1]]


def text_of(evts: list, chat: bool) -> str:
    if chat:
        return "".join(e["choices"][0]["delta"].get("content", "") for e in evts if e["choices"])
    return "".join(e["choices"][0]["text"] for e in evts if e["choices"])


VARIANTS = [(COMPLETIONS, {}), (COMPLETIONS, {"echo": True}), (COMPLETIONS, {"logprobs": 2}),
            (COMPLETIONS, {"echo": True, "logprobs": 2}), (COMPLETIONS, {"prompt_logprobs": 1}),
            (CHAT, {}), (CHAT, {"logprobs": True, "top_logprobs": 2})]


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("path,extra", VARIANTS)
def test_a_stream_cut_after_k_tokens_is_identical_to_an_uncut_run(app, path, extra, sampling):
    chat = path == CHAT
    head = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT}
    body = {**head, "max_tokens": N, "stream": True, "stream_options": {"include_usage": True},
            **SAMPLING[sampling], **extra}
    reference = None
    for cut in (0, 1, 3, N):
        content, start, calls = through_ingress(app, path, body, cut)
        assert start["status"] == 200
        resume = calls[1]["resume"]
        assert len(resume["tokens"]) == cut and resume["opened"] == (cut > 0 or chat)
        if reference is None or sampling == "unseeded":  # it keeps the seed it drew
            assert resume["seed"] is not None
            seeded = {**body, "seed": resume["seed"]} if sampling == "unseeded" else body
            reference = events(through_ingress(app, path, seeded)[0])
            for e in reference:  # one id and created for the whole stream
                e["id"] = e["created"] = None
        got = events(content)
        assert {(e["id"], e["created"]) for e in got} == {(resume["id"], resume["created"])}
        for e in got:
            e["id"] = e["created"] = None
        assert got == reference, f"cut after {cut} tokens"
        usage = got[-1]["usage"]
        assert usage["completion_tokens"] == N and got[-2]["choices"][0]["finish_reason"] \
            == "length"
    if chat:
        assert reference[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert sum(1 for e in reference if e["choices"]
                   and "role" in e["choices"][0]["delta"]) == 1


def test_a_stop_string_spanning_the_cut(app):
    body = {"prompt": PROMPT, "max_tokens": N, "stream": True}
    tok = ByteTokenizer()
    tokens = [t for e in events(through_ingress(app, COMPLETIONS, body)[0])
              for t in e["choices"][0]["token_ids"]]
    pieces = [tok.decode([t]) for t in tokens]
    boundary = sum(len(p) for p in pieces[:3])
    text = "".join(pieces)
    stop = text[boundary - 2:boundary + 2]  # the last 2 chars of token 2, first 2 of token 3
    assert len(stop) == 4 and text.find(stop) == boundary - 2
    stopped = {**body, "stop": [stop]}
    reference = events(through_ingress(app, COMPLETIONS, stopped)[0])
    assert reference[-1]["choices"][0]["finish_reason"] == "stop"
    assert text_of(reference, False) == text[:boundary - 2]
    for e in reference:
        e["id"] = e["created"] = None
    for cut in (1, 2, 3, 4):
        got = events(through_ingress(app, COMPLETIONS, stopped, cut)[0])
        for e in got:
            e["id"] = e["created"] = None
        assert got == reference, f"cut after {cut} tokens"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("sampling", ["greedy", "seeded", "unseeded"])
def test_a_whole_answer_interrupted_before_it_was_sent_is_rerun_identically(app, path,
                                                                           sampling):
    head = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT \
        else {"prompt": PROMPT}
    body = {**head, "max_tokens": N, **SAMPLING[sampling]}
    content, start, calls = through_ingress(app, path, body, cut=0)
    assert start["status"] == 200
    seed = calls[1]["resume"]["seed"]
    reference = json.loads(through_ingress(app, path, {**body, "seed": seed})[0])
    got = json.loads(content)
    assert (got["id"], got["created"]) == (calls[1]["resume"]["id"],
                                           calls[1]["resume"]["created"])
    for answer in (got, reference):
        answer["id"] = answer["created"] = None
    assert got == reference and got["usage"]["completion_tokens"] == N


def relayed(app, path: str, body: dict, resume: dict | None, progress: bool = True):
    """The messages of ``body`` served by ``app`` through ``serve_relayed``."""
    request = {"method": "POST", "path": path, "query_string": b"", "http_version": "1.1",
               "headers": [(b"content-type", b"application/json")],
               "body": json.dumps(body).encode(), "progress": progress}
    if resume is not None:
        request["resume"] = resume

    async def go():
        return [m async for m in serve_relayed(app, request)]
    return asyncio.run(go())


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_whole_answer_resumed_from_k_tokens_equals_the_uncut_one(app, path):
    head = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT \
        else {"prompt": PROMPT}
    body = {**head, "max_tokens": N, "temperature": 0.8, "seed": 9}
    whole = json.loads(relayed(app, path, body, None)[-1]["body"])
    tokens = whole["choices"][0]["token_ids"]
    for k in (1, 4, N):
        messages = relayed(app, path, body, {"tokens": tokens[:k], "seed": 9, "id": "x",
                                             "created": 5})
        got = json.loads(messages[-1]["body"])
        assert (got["id"], got["created"]) == ("x", 5)
        got["id"], got["created"] = whole["id"], whole["created"]
        assert got == whole, f"resumed after {k} tokens"


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1}, {"logprobs": 2}])
def test_a_whole_answer_with_logprobs_resumed_from_k_tokens_equals_the_uncut_one(app, extra):
    """A whole answer carries every token's logprobs and the prompt's rows: resumed after k
    tokens it restarts from the prompt with the same seed (``continue_from``), so it is the
    uncut answer, prompt_logprobs included."""
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0.8, "seed": 9, **extra}
    whole = json.loads(relayed(app, COMPLETIONS, body, None)[-1]["body"])
    tokens = whole["choices"][0]["token_ids"]
    resume = {"tokens": tokens[:2], "seed": 9, "id": "x", "created": 5}
    got = json.loads(relayed(app, COMPLETIONS, body, resume)[-1]["body"])
    got["id"], got["created"] = whole["id"], whole["created"]
    assert got == whole

def test_progress_messages_only_when_asked_and_never_over_http(app):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    assert not [m for m in relayed(app, COMPLETIONS, body, None, progress=False)
                if m["type"] == PROGRESS_TYPE]
    kinds = [m["type"] for m in relayed(app, COMPLETIONS, body, None)]
    assert kinds.count(PROGRESS_TYPE) == 5  # admitted, one per token, final
    with TestClient(app) as client:
        plain = client.post(COMPLETIONS, json=body)
        assert "calexec.progress" not in plain.text
        # resume state in the body is refused, naming it; in a header it is just a header
        forged = client.post(COMPLETIONS, json={**body, "resume": {"tokens": [300] * 3}})
        assert forged.status_code == 400 and forged.json()["error"]["param"] == "resume"
        header = client.post(COMPLETIONS, json=body, headers={
            "calexec.resume": json.dumps({"tokens": [300, 300], "id": "forged"})})
        assert header.status_code == 200 and "forged" not in header.text
        same = [e["choices"][0]["token_ids"] for e in events(header.content)[:-1]]
        assert same == [e["choices"][0]["token_ids"] for e in events(plain.content)[:-1]]


def test_a_bad_resume_state_is_refused_naming_the_field(app):
    body = {"prompt": PROMPT, "max_tokens": 3}
    for resume, what in [({"tokens": [1] * 4}, "max_tokens"), ({"tokens": [-1]}, "tokens"),
                         ({"tokens": [1 << 30]}, "vocabulary"), ({"bogus": 1}, "bogus")]:
        messages = relayed(app, COMPLETIONS, body, resume)
        assert messages[0]["status"] == 400, resume
        error = json.loads(messages[-1]["body"])["error"]
        assert error["param"] == "resume" and what in error["message"]


@pytest.mark.parametrize("text,stop", [("aé€😀b", ()), ("xx€yy€zz", ("€y",)),
                                       ("stop here, please", ("p h", "ease")),
                                       ("ab\u00e9cd", ("\u00e9c",))])
def test_text_state_rebuilt_from_the_tokens_loses_and_repeats_nothing(text, stop):
    """What a sibling does with the tokens so far (``continue_from``): feed them to a fresh
    ``TextOutput``, keep nothing of its output, then go on. Every cut, multi-byte UTF-8
    characters and stop strings split across it included, gives the uncut text."""
    tok = ByteTokenizer()
    tokens = [BYTE_OFFSET + b for b in text.encode("utf-8")]

    def run(out, ids):
        pieces = [out.add(t) for t in ids]
        return pieces, out

    uncut, whole = run(TextOutput(tok, stop), tokens)
    expected = "".join(uncut) + whole.flush()
    for k in range(len(tokens) + 1):
        first, _ = run(TextOutput(tok, stop), tokens[:k])
        _, rebuilt = run(TextOutput(tok, stop), tokens[:k])  # the sibling's replay, unsent
        rest, out = run(rebuilt, tokens[k:])
        assert "".join(first) + "".join(rest) + out.flush() == expected, f"cut at {k}"
        assert out.stopped == whole.stopped


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_draining_replica_hands_the_request_to_a_sibling_at_a_token_boundary(app, path,
                                                                              stream):
    head = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT \
        else {"prompt": PROMPT}
    body = {**head, "max_tokens": N, "stream": stream, **SAMPLING["seeded"]}
    reference = through_ingress(app, path, body)[0]
    content, start, calls = through_ingress(app, path, body, cut=0 if not stream else 3,
                                            drain=True)
    assert start["status"] == 200
    if stream:
        assert 3 <= len(calls[1]["resume"]["tokens"]) < N
        got, want = events(content), events(reference)
    else:
        assert calls[1]["resume"]["tokens"] == []  # a whole answer is re-run
        got, want = json.loads(content), json.loads(reference)
        got, want = [got], [want]
    for e in got + want:
        e["id"] = e["created"] = None
    assert got == want
