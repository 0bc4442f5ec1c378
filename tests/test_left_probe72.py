"""Stop 72 (left): defects of the reference server left by stop 71, each proven here.

* an operator call (``CompletionService.operator_call``: a reload's calbin check and model
  switch, a job page's drawing) waited for its turn without a bound;
* the later choices of an admitted request (``n`` > 1, a prompt list) met ``max_waiting`` and
  the client got a 429 after earlier choices ran;
* ``tool_choice: {"type": "allowed_tools", ...}`` was refused;
* the fleet ingress's 413 gave the single server's advice;
"""

from __future__ import annotations

import contextlib
import threading

import httpx
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.serving.server import ServerConfig, create_app
from tests.test_server_support import LiveServer, started_executor, wait_for

WAIT_S = 30.0
TOKEN = "left72-admin"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class _Gate:
    """A stand-in for ``check_calbin`` that holds every caller until opened, counting them."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = 0
        self._mu = threading.Lock()

    def __call__(self, path: object, max_bytes: int | None = None) -> Status:
        with self._mu:
            self.entered += 1
        self.open.wait(WAIT_S)
        return Status.failure("calbin.not_found", Category.INVALID_REQUEST, Phase.VALIDATE,
                              f"calbin={path!r}: held by the test")


def _reload_in_thread(url: str, calbin: str, answers: list) -> threading.Thread:
    def post() -> None:
        answers.append(httpx.post(f"{url}/admin/reload", headers=AUTH,
                                  json={"calbin": calbin}, timeout=WAIT_S))
    thread = threading.Thread(target=post)
    thread.start()
    return thread


@contextlib.contextmanager
def _both_operator_turns_held(tmp_path, monkeypatch, wait_s: float):
    """A live server whose two operator turns (``OPERATOR_THREADS``) are held by two reloads
    stuck in a gated calbin check, after one finished completion; yields the server, the gate,
    the finished job's id, the reload answers and the threads to join. Opens the gate, joins
    every thread and shuts the executor down on the way out."""
    executor = started_executor(tmp_path)
    gate = _Gate()
    monkeypatch.setattr(executor, "check_calbin", gate)
    app = create_app(executor, ServerConfig(admin_token=TOKEN, operator_wait_s=wait_s))
    reloads: list = []
    threads: list = []
    try:
        with LiveServer(app) as server:
            done = httpx.post(f"{server.url}/v1/completions",
                              json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=WAIT_S)
            assert done.status_code == 200, done.text
            job_id = next(i for i in range(1, 1000) if executor.job_trail(i) is not None)
            threads += [_reload_in_thread(server.url, f"held{i}.calbin", reloads)
                        for i in range(2)]
            wait_for(lambda: gate.entered == 2, WAIT_S, "both calbin checks held")
            yield server, gate, job_id, reloads, threads
    finally:
        gate.open.set()
        for thread in threads:
            thread.join(WAIT_S)
        executor.shutdown(5.0)


@pytest.mark.parametrize("wait_s", [0.0, 0.05])
def test_a_job_page_behind_busy_operator_calls_is_answered_429_naming_them(
        tmp_path, monkeypatch, wait_s):
    """Two reloads whose calbin checks hold both operator turns (``OPERATOR_THREADS``): a job
    page's drawing asked meanwhile waits at most ``operator_wait_s`` (0: not at all), then is
    answered 429 ``operator.busy`` with ``Retry-After``, naming both checks; until stop 72 it
    waited for them without a bound. Once they answered, the page is drawn again."""
    with _both_operator_turns_held(tmp_path, monkeypatch, wait_s) as (
            server, gate, job_id, reloads, threads):
        page = httpx.get(f"{server.url}/debug/jobs/{job_id}", headers=AUTH, timeout=5.0)
        assert page.status_code == 429, page.text
        assert page.headers["retry-after"] == "1"
        error = page.json()["error"]
        assert error["code"] == "operator.busy" and error["param"] == "job_id", error
        assert f"GET /debug/jobs/{job_id}: its drawing: not run" in error["message"]
        for name in ("held0.calbin", "held1.calbin"):
            assert f'the check of calbin "{name}"' in error["message"], error["message"]
        # the JSON view needs no turn
        data = httpx.get(f"{server.url}/debug/jobs/{job_id}?format=json", headers=AUTH,
                         timeout=5.0)
        assert data.status_code == 200, data.text
        gate.open.set()
        for thread in threads:
            thread.join(WAIT_S)
        assert sorted(r.status_code for r in reloads) == [400, 400], reloads
        again = httpx.get(f"{server.url}/debug/jobs/{job_id}", headers=AUTH, timeout=WAIT_S)
        assert again.status_code in (200, 503), again.text  # 503: no graphviz here
        assert again.status_code == 200 or "graphviz" in again.text


def test_an_operator_call_waiting_for_its_turn_runs_once_one_is_free(tmp_path, monkeypatch):
    """With a bound to wait (the default 10 s), a job page asked while both turns are held
    waits for one (no answer yet) and is drawn once a check ends: the bound refuses only a
    wait that would outlast it."""
    pages: list = []
    with _both_operator_turns_held(tmp_path, monkeypatch, 600.0) as (
            server, gate, job_id, _reloads, threads):
        asker = threading.Thread(target=lambda: pages.append(httpx.get(
            f"{server.url}/debug/jobs/{job_id}", headers=AUTH, timeout=WAIT_S)))
        asker.start()
        threads.append(asker)
        assert pages == []  # (it waits for a turn: no answer while both are held)
        gate.open.set()
        for thread in threads:
            thread.join(WAIT_S)
        assert len(pages) == 1 and pages[0].status_code in (200, 503), pages
        assert pages[0].status_code == 200 or "graphviz" in pages[0].text


@pytest.mark.parametrize("body", [
    {"prompt": [5, 6, 7], "max_tokens": 3, "n": 2},
    {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3},
    {"prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "stream": True},
], ids=["n2", "prompt_list", "n2_stream"])
def test_the_later_choices_of_an_admitted_request_wait_past_max_waiting(tmp_path, body):
    """``max_waiting`` 0 (never wait) and one sequence id free of four (three held through
    the service's pool): a request of two choices is admitted, its first choice takes the id
    and its second waits for it, whatever ``max_waiting`` says: a request admitted is served
    whole. Until stop 72 the second choice met ``max_waiting`` as a new request would and
    the client got 429 ``kv.full`` for a request whose first choice had already run."""
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(max_sequences=4, max_waiting=0))
    service = app.state.service
    held = [service.sequences.acquire() for _ in range(3)]
    try:
        with LiveServer(app) as server:
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=WAIT_S)
            assert r.status_code == 200, r.text
            if body.get("stream"):
                assert r.text.rstrip().endswith("data: [DONE]"), r.text
                assert '"error"' not in r.text, r.text
                finished = r.text.count('"finish_reason":"length"')
            else:
                choices = r.json()["choices"]
                finished = sum(c["finish_reason"] == "length" for c in choices)
                assert [len(c["token_ids"]) for c in choices] == [3, 3], choices
            assert finished == 2, r.text
            # a request that is not admitted is still refused at once (0: nobody waits)
            alone = httpx.post(f"{server.url}/v1/completions",
                               json={"prompt": [5], "max_tokens": 1}, timeout=WAIT_S)
            assert alone.status_code == 200, alone.text  # (an id is free again)
            held.append(service.sequences.acquire())
            refused = httpx.post(f"{server.url}/v1/completions",
                                 json={"prompt": [5], "max_tokens": 1}, timeout=WAIT_S)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "kv.full"
    finally:
        for seq_id in held:
            if seq_id is not None:
                service.sequences.release(seq_id)
        executor.shutdown(5.0)


# ---- tool_choice: allowed_tools -------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}


def allowed(mode: str, *names: str) -> dict:
    """Chat's ``tool_choice`` allowing the tools ``names`` (OpenAI's shape)."""
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    pytest.importorskip("llguidance")
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    try:
        with LiveServer(create_app(executor, ServerConfig())) as server:
            yield server
    finally:
        executor.shutdown(5.0)


def _chat(server, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": "calexec-qwen3-synthetic", "messages": [{"role": "user", "content": "answer"}],
        "max_tokens": 80, "parallel_tool_calls": False, "tools": [WEATHER, CLOCK], **fields},
        timeout=60)


def test_allowed_tools_required_calls_only_the_listed_tool(tool_server):
    """``tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode": "required",
    "tools": [get_time]}}`` with both tools declared: every choice calls ``get_time`` (the
    grammar offers no other), and the prompt is the one of ``tool_choice: "required"`` (the
    template still lists both tools: what ``allowed_tools`` keeps, the prompt and its cache).
    Until stop 72 it was a 400 ``tool_choice=...: must be "none", "auto", "required" or
    {"type": "function", ...}``."""
    r = _chat(tool_server, tool_choice=allowed("required", "get_time"), n=4, temperature=1.0,
              seed=11)
    assert r.status_code == 200, r.text
    answer = r.json()
    names = [call["function"]["name"] for choice in answer["choices"]
             for call in choice["message"]["tool_calls"]]
    assert len(names) == 4 and set(names) == {"get_time"}, answer
    assert all(c["finish_reason"] == "tool_calls" for c in answer["choices"]), answer
    plain = _chat(tool_server, tool_choice="required", max_tokens=1)
    assert plain.status_code == 200, plain.text
    assert answer["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


def test_allowed_tools_auto_calls_no_other_tool(tool_server):
    """``mode: "auto"``: text, or calls of the listed tools only."""
    r = _chat(tool_server, tool_choice=allowed("auto", "get_weather"), n=4, temperature=1.0,
              seed=3)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        for call in choice["message"].get("tool_calls") or []:
            assert call["function"]["name"] == "get_weather", choice


def test_allowed_tools_through_the_sdk_and_the_responses_api(tool_server):
    """The official SDK sends chat's shape as it is; ``/v1/responses`` takes the Responses'
    (``{"type": "allowed_tools", "mode", "tools": [{"type": "function", "name"}]}``)."""
    import openai
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    done = client.chat.completions.create(
        model="calexec-qwen3-synthetic", messages=[{"role": "user", "content": "answer"}],
        tools=[WEATHER, CLOCK], tool_choice=allowed("required", "get_weather"),
        parallel_tool_calls=False, max_tokens=80)
    assert [c.function.name for c in done.choices[0].message.tool_calls] == ["get_weather"]
    flat = [{"type": "function", **t["function"]} for t in (WEATHER, CLOCK)]
    r = httpx.post(f"{tool_server.url}/v1/responses", json={
        "model": "calexec-qwen3-synthetic", "input": "answer", "tools": flat,
        "parallel_tool_calls": False, "max_output_tokens": 80,
        "tool_choice": {"type": "allowed_tools", "mode": "required",
                        "tools": [{"type": "function", "name": "get_time"}]}}, timeout=60)
    assert r.status_code == 200, r.text
    calls = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_time"], r.json()


@pytest.mark.parametrize("choice,param,words", [
    (allowed("required", "nope"), "tool_choice.allowed_tools.tools.0.function.name",
     ['"nope"', "not one of the tools", "get_weather", "get_time"]),
    (allowed("required", "get_time", "get_time"),
     "tool_choice.allowed_tools.tools.1.function.name", ["listed twice"]),
    (allowed("sometimes", "get_time"), "tool_choice.allowed_tools.mode",
     ['"sometimes"', '"auto" or "required"']),
    (allowed("auto"), "tool_choice.allowed_tools.tools", ["one tool or more"]),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "custom", "custom": {"name": "x"}}]}},
     "tool_choice.allowed_tools.tools.0.type", ['"custom"', "only \"function\""]),
    ({"type": "allowed_tools"}, "tool_choice.allowed_tools", ["must be an object"]),
])
def test_allowed_tools_refusals_name_the_field(tool_server, choice, param, words):
    r = _chat(tool_server, tool_choice=choice)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_allowed_tools_refusals_on_the_responses_api_name_its_fields(tool_server):
    flat = [{"type": "function", **t["function"]} for t in (WEATHER, CLOCK)]
    r = httpx.post(f"{tool_server.url}/v1/responses", json={
        "model": "calexec-qwen3-synthetic", "input": "answer", "tools": flat,
        "tool_choice": {"type": "allowed_tools", "mode": "auto",
                        "tools": [{"type": "function", "name": "nope"}]}}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice.tools.0.name", error
    assert error["message"].startswith('tool_choice.tools.0.name="nope": not one of the tools'), \
        error


# ---- the fleet ingress's 413 ----------------------------------------------------------------
def _ingress_answer(path: str, body: bytes, limit: int) -> tuple[int, dict]:
    """The status and JSON body the fleet ingress answers ``body`` to ``path`` with, its
    ``max_body_bytes`` ``limit`` (no replica is called: the answer is the ingress's)."""
    import asyncio
    import json

    from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress

    def call(request):
        raise AssertionError(f"a replica was called for {path}")
    ingress = FleetIngress(call, FailoverSettings(max_body_bytes=limit))
    sent: list[dict] = []

    async def go() -> None:
        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "headers": [(b"content-type", b"application/json")],
                 "http_version": "1.1"}
        given = [False]

        async def receive():
            if not given[0]:
                given[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)
        await asyncio.wait_for(ingress(scope, receive, send), timeout=WAIT_S)
    asyncio.run(go())
    start = next(m for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(payload)


def test_the_fleet_ingress_413_gives_the_fleets_advice_and_the_admin_routes_words():
    """A body over the fleet's ``max_body_bytes``: an API route's 413 tells the client the
    fleet's flag (``calexec serve --ray --max-body-bytes``: the ingress's limit and every
    replica's), an admin route's what the route takes, as a single server's admin 413 says
    since stop 71. Until stop 72 every route was told the single server's "start the server
    with a larger --max-body-bytes", a reload's calbin sent as its bytes included."""
    big = b'{"prompt": "' + b"x" * 300 + b'"}'
    status, body = _ingress_answer("/v1/completions", big, 128)
    message = body["error"]["message"]
    assert status == 413, body
    assert message.startswith("request body exceeds max_body_bytes=128: send a smaller body"), \
        message
    assert "start the fleet with a larger --max-body-bytes (calexec serve --ray" in message
    assert "start the server" not in message
    status, body = _ingress_answer("/admin/reload", b'{"calbin": "' + b"\\u0000" * 100 + b'"}',
                                   128)
    message = body["error"]["message"]
    assert status == 413, body
    assert "/admin/reload takes {\"calbin\": PATH}, the path of a calbin file" in message, message
    assert "fewer or shorter prompts" not in message
    status, body = _ingress_answer("/admin/drain", b"x" * 300, 128)
    assert status == 413 and "/admin/drain takes no body" in body["error"]["message"], body
