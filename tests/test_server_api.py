"""The reference server through FastAPI's TestClient (in-process ASGI; no sockets)."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from fastapi.testclient import TestClient

from calexec.drivers.calrt.runtime import Emulator, Fault, FaultMode
from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.dumpsink import DumpConfigError, DumpSink
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    SVG_ACTIVE,
    metric_value,
    oracle_tokens,
    server_idle,
    started_executor,
    wait_for,
)

TOKEN = "test-admin-token"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    app = create_app(executor, ServerConfig(admin_token=TOKEN, max_body_bytes=4096))
    with TestClient(app) as client:
        yield client, app.state.service
    executor.shutdown(5.0)


@pytest.fixture
def fresh(tmp_path):
    """A function-scoped (executor, factory) pair for tests that change the device or drain."""
    made = []

    def make(device_config: str = "", **config):
        executor = started_executor(tmp_path, device_config)
        made.append(executor)
        return executor, create_app(executor, ServerConfig(**{"admin_token": TOKEN, **config}))
    yield make
    for executor in made:
        executor.shutdown(5.0)


def complete(client, **body):
    return client.post("/v1/completions", json=body)


# ---- completions --------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", [[5, 6, 7, 8], [151935], list(range(100, 140))])
def test_greedy_tokens_equal_the_oracle(served, prompt):
    client, service = served
    r = complete(client, prompt=prompt, max_tokens=6)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    expected = oracle_tokens(prompt, 6)
    assert choice["token_ids"] == expected
    assert choice["text"] == tokenizer.decode(expected)
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6,
                                 "total_tokens": len(prompt) + 6}
    assert service.sequences.in_use == 0


def test_text_prompt_goes_through_the_byte_tokenizer(served):
    client, _ = served
    r = complete(client, prompt="héllo", max_tokens=3)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("héllo".encode())
    assert r.json()["choices"][0]["token_ids"] == oracle_tokens(tokenizer.encode("héllo"), 3)


def test_streaming_chunks_concatenate_to_the_non_streaming_text(served):
    client, _ = served
    plain = complete(client, prompt=[9, 10, 11], max_tokens=5).json()["choices"][0]
    r = complete(client, prompt=[9, 10, 11], max_tokens=5, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == plain["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # usage only on a usage chunk, and only with stream_options.include_usage (issue 27)
    assert "usage" not in chunks[-1]


def test_end_token_stops_the_generation(fresh):
    prompt = [40, 41, 42]
    expected = oracle_tokens(prompt, 4)
    _, app = fresh(end_token_id=expected[2])
    with TestClient(app) as client:
        body = complete(client, prompt=prompt, max_tokens=10).json()
    assert body["choices"][0]["token_ids"] == expected[:3]  # the end token listed (as vLLM)
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "stop"


# ---- 400 / 413 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 151936]}, "prompt"),              # out of vocabulary
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": []}, "prompt"),                       # empty
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1], "max_tokens": 40960}, "max_tokens"),  # 1 + 40960 > max_seq
    ({"prompt": [1] * 40961}, "prompt"),              # longer than max_seq (body limit raised)
    ({"prompt": [1], "max_tokens": "3"}, "max_tokens"),     # wrong type
    ({"prompt": [1], "max_tokens": -1}, "max_tokens"),
    ({"prompt": [1], "stream": "yes"}, "stream"),
    ({"prompt": [1], "n": 129}, "n"),                # above max_choices (128)
    ({"max_tokens": 3}, "prompt"),                    # missing
])
def test_bad_input_is_400_with_a_json_body_and_serving_continues(fresh, body, param):
    _, app = fresh(max_body_bytes=1 << 20)
    with TestClient(app) as client:
        r = complete(client, **body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param
        assert r.json()["status"]["http_status"] == 400
        assert complete(client, prompt=[1, 2], max_tokens=1).status_code == 200



def test_a_request_filling_the_context_exactly_is_served(fresh):
    """max_seq (40960) is the limit, inclusive: a prompt of exactly max_seq tokens (echo, no
    completion), and prompt + max_tokens = max_seq, are served; one token more is a 400."""
    _, app = fresh(max_body_bytes=1 << 20)
    with TestClient(app) as client:
        r = complete(client, prompt=[1] * 40960, max_tokens=0, echo=True)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["prompt_tokens"] == 40960
        first = oracle_tokens([1, 2], 1)[0]  # a stop token id: the answer ends at once
        r = complete(client, prompt=[1, 2], max_tokens=40958, stop_token_ids=[first])
        assert r.status_code == 200, r.text[:300]
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        r = complete(client, prompt=[1, 2], max_tokens=40959)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_a_timeout_of_exactly_max_timeout_s_is_accepted(served):
    client, _ = served
    r = complete(client, prompt=[1, 2], max_tokens=1, timeout=600)  # max_timeout_s, inclusive
    assert r.status_code == 200, r.text
    r = complete(client, prompt=[1, 2], max_tokens=1, timeout=600.5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text
    assert "max_timeout_s=600" in r.json()["error"]["message"]

def test_malformed_json_is_400(served):
    client, _ = served
    r = client.post("/v1/completions", content=b'{"prompt": [1, 2', headers={
        "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "request.invalid"
    assert complete(client, prompt=[3], max_tokens=1).status_code == 200



def test_a_body_of_exactly_max_body_bytes_is_read(served):
    """max_body_bytes (4096 here) is inclusive: a body of exactly that many bytes is served,
    one byte more is a 413."""
    client, _ = served
    body = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()
    exact = body + b" " * (4096 - len(body))  # (JSON allows the trailing whitespace)
    headers = {"content-type": "application/json"}
    r = client.post("/v1/completions", content=exact, headers=headers)
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", content=exact + b" ", headers=headers)
    assert r.status_code == 413 and "max_body_bytes=4096" in r.json()["error"]["message"]

def test_body_over_the_limit_is_413(served):
    client, _ = served
    r = complete(client, prompt=[1] * 3000)  # > 4096 bytes of JSON
    assert r.status_code == 413
    assert "max_body_bytes=4096" in r.json()["error"]["message"]


# ---- 429 / 504 / 503 ------------------------------------------------------------------------------
def test_kv_exhausted_is_429_with_retry_after(fresh):
    executor, app = fresh()
    # the KvManager says "no capacity" to every ask: the request waits (holding no KV) until
    # its deadline, then 429
    executor.device.emu.set_fault(Fault.CAN_ALLOCATE_FALSE, FaultMode.ALWAYS, 1)
    with TestClient(app) as client:
        r = complete(client, prompt=list(range(1, 41)), max_tokens=1, timeout=0.2)
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["status"]["code"] == "kv.deadline"
        assert r.json()["status"]["category"] == "resource_exhausted"
        executor.device.emu.clear_fault(Fault.CAN_ALLOCATE_FALSE)
        assert complete(client, prompt=[1, 2, 3], max_tokens=2).status_code == 200
    assert app.state.service.sequences.in_use == 0


def test_a_request_that_can_never_fit_the_kv_is_400_at_once(fresh):
    """Issue 13 defect 7: 2 blocks of 16 tokens (the 19-token golden fits); 40 prompt tokens
    + 1 can never fit. Before: it waited for capacity until its deadline (30 s here), then
    429. Now: refused at once, 400 naming max_tokens, before any KV is taken."""
    executor, app = fresh("kv_blocks=2;kv_block_size=16")
    with TestClient(app) as client:
        r = complete(client, prompt=list(range(1, 41)), max_tokens=1, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "kv.exceeds_capacity" and err["param"] == "max_tokens"
        assert "41 tokens" in err["message"] and "capacity of 2 blocks" in err["message"]
        assert complete(client, prompt=[1, 2, 3], max_tokens=2).status_code == 200
    assert app.state.service.sequences.in_use == 0


@pytest.mark.parametrize("extra", [{}, {"stream": True}, {"n": 2}, {"n": 2, "stream": True}])
def test_a_chat_that_can_never_fit_the_kv_names_the_field_it_sent(fresh, extra):
    """A chat whose ``max_completion_tokens`` (the SDK's current field, LangChain's) can never
    fit the KV was refused naming ``max_tokens`` (``param`` and "shorten the prompt or
    max_tokens"), a field its body did not have; whole, streamed, several choices."""
    executor, app = fresh("kv_blocks=2;kv_block_size=16")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 30,
            **extra}
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "kv.exceeds_capacity", err
        assert err["param"] == "max_completion_tokens", err
        assert err["message"].endswith("shorten the prompt or max_completion_tokens"), err
        given_max_tokens = {**chat, "max_tokens": 30}
        del given_max_tokens["max_completion_tokens"]
        err = client.post("/v1/chat/completions", json=given_max_tokens).json()["error"]
        assert err["param"] == "max_tokens" and err["message"].endswith("or max_tokens"), err
    # a choice cancelled by the other's refusal while its enqueue ran in a worker thread gives
    # its sequence back from the background (``release_later``) once that enqueue ended: the
    # response does not wait for it (CI, at load, read the id still in use here)
    wait_for(lambda: server_idle(app.state.service), what="every sequence released")


def test_sequence_ids_exhausted_is_429_when_nobody_may_wait(fresh):
    """max_waiting=0: no waiting queue, exhaustion is refused at once (issue 16 keeps it)."""
    executor, app = fresh(max_sequences=1, max_waiting=0)
    service = app.state.service
    held = service.sequences.acquire()
    with TestClient(app) as client:
        r = complete(client, prompt=[1], max_tokens=1)
        assert r.status_code == 429 and r.json()["error"]["code"] == "kv.full"
        assert r.headers["retry-after"] == "1"
        service.sequences.release(held)
        assert complete(client, prompt=[1], max_tokens=1).status_code == 200


def test_a_request_without_a_free_sequence_id_waits_until_its_deadline(fresh):
    """Issue 16: no free id -> the request waits (it used to be an immediate 429) and ends
    504 admission.deadline when none is freed before its deadline."""
    executor, app = fresh(max_sequences=1)
    service = app.state.service
    held = service.sequences.acquire()
    with TestClient(app) as client:
        r = complete(client, prompt=[1], max_tokens=1, timeout=0.2)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "admission.deadline"
        assert "waiting" in r.json()["error"]["message"]
        assert service.admission.waiting == 0
        service.sequences.release(held)
        assert complete(client, prompt=[1], max_tokens=1).status_code == 200


def test_deadline_is_504_and_the_sequence_is_released_after_the_job(fresh):
    executor, app = fresh()
    Emulator(executor.device).set_latency(decode_us=300_000)
    with TestClient(app) as client:
        r = complete(client, prompt=[1, 2, 3], max_tokens=3, timeout=0.1)
        assert r.status_code == 504, r.text
        assert r.json()["status"]["category"] == "deadline"
    service = app.state.service
    assert service.active == 0
    # the id comes back once the job ended (in the background), never before
    wait_for(lambda: service.sequences.in_use == 0, what="the sequence's release")
    assert executor.snapshot()["inflight"] == 0 and service.sequences.consistent()


def test_drain_makes_ready_and_completions_503(fresh):
    executor, app = fresh()
    service = app.state.service
    with TestClient(app) as client:
        assert client.get("/ready").status_code == 200
        assert client.post("/admin/drain", params={"grace": 5},
                           headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 202
        wait_for(lambda: service.drain_status is not None, what="drain")
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        r = complete(client, prompt=[1], max_tokens=1)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "unavailable_error"
        assert client.get("/health").status_code == 200
    assert service.drain_status.ok and executor.state == "Stopped"



def test_a_drain_with_grace_0_is_accepted_and_a_negative_one_refused(fresh):
    """The grace is in [0, max_drain_grace_s]: 0 (stop at once) is a drain, -1 a 400."""
    executor, app = fresh()
    service = app.state.service
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(app) as client:
        r = client.post("/admin/drain", params={"grace": -1}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "grace", r.text
        assert not service.draining
        r = client.post("/admin/drain", params={"grace": 0}, headers=auth)
        assert r.status_code == 202 and r.json()["grace"] == 0, r.text
        wait_for(lambda: service.drain_status is not None, what="drain")
    assert service.drain_status.ok and executor.state == "Stopped"

# ---- admin ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers, code", [({}, 401), ({"Authorization": "Bearer nope"}, 403),
                                           ({"Authorization": f"Basic {TOKEN}"}, 401)])
def test_admin_refused_without_the_token(served, headers, code):
    client, service = served
    assert client.post("/admin/drain", headers=headers).status_code == code
    assert not service.draining and client.get("/ready").status_code == 200


def test_admin_drain_refuses_a_bad_grace(served):
    client, service = served
    r = client.post("/admin/drain", params={"grace": "soon"},
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grace"
    assert not service.draining


def test_admin_disabled_without_a_configured_token(fresh):
    _, app = fresh(admin_token=None)
    with TestClient(app) as client:
        r = client.post("/admin/drain", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin.disabled"


def test_a_reload_during_a_drain_is_refused_naming_the_drain(fresh, tmp_path):
    """A drain started (its body ``{}``, a client's ``json={}``, says nothing and is
    accepted): a reload of a good calbin is a 503 saying the server is draining, and the
    lifecycle does not move."""
    from calexec.drivers.synthetic import calbin as cb
    executor, app = fresh()
    other = tmp_path / "other.calbin"
    cb.write(str(other), cb.default_spec(seed=cb.DEFAULT_SEED ^ 0x77))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(app) as client:
        r = client.post("/admin/drain", params={"grace": 30}, json={}, headers=auth)
        assert r.status_code == 202, r.text
        r = client.post("/admin/reload", json={"calbin": str(other)}, headers=auth)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["param"] == "calbin" and "server is draining" in error["message"], error
    assert executor.gen is None or executor.gen.id == 1


def test_admin_reload_switches_the_model_and_rolls_back_a_bad_one(fresh, tmp_path):
    from calexec.drivers.synthetic import calbin as cb
    executor, app = fresh()
    other_seed = cb.DEFAULT_SEED ^ 0x77
    other = tmp_path / "other.calbin"
    other_sha = cb.write(str(other), cb.default_spec(seed=other_seed))
    executor.goldens[other_sha] = tuple(oracle_tokens(list(executor.config.golden_tokens),
                                                      executor.config.golden_decode_steps + 1,
                                                      other_seed))  # the operator pins it
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(app) as client:
        assert client.post("/admin/reload", json={"calbin": str(other)}).status_code == 401
        r = client.post("/admin/reload", json={"calbin": str(other)}, headers=auth)
        assert r.status_code == 200 and r.json()["generation"] == 2, r.text
        assert client.get("/ready").status_code == 200
        r = complete(client, prompt=[5, 6, 7], max_tokens=4)
        assert r.json()["choices"][0]["token_ids"] == oracle_tokens([5, 6, 7], 4, other_seed)
        corrupt = tmp_path / "corrupt.calbin"
        corrupt.write_bytes(b"not a calbin" * 10)
        r = client.post("/admin/reload", json={"calbin": str(corrupt)}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "calbin.invalid", r.text
        assert r.json()["error"]["param"] == "calbin" and executor.gen.id == 2  # nothing moved
        unpinned = tmp_path / "unpinned.calbin"  # a calbin, but no golden pinned for it
        cb.write(str(unpinned), cb.default_spec(seed=other_seed ^ 0x11))
        r = client.post("/admin/reload", json={"calbin": str(unpinned)}, headers=auth)
        assert r.status_code == 500 and r.json()["status"]["code"] == "recovery.rolled_back"
        r = complete(client, prompt=[5, 6, 7], max_tokens=4)  # the previous model serves
        assert r.json()["choices"][0]["token_ids"] == oracle_tokens([5, 6, 7], 4, other_seed)
        r = client.post("/admin/reload", json={}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "calbin"


# ---- metrics --------------------------------------------------------------------------------------------
def test_metrics_exist_and_move_after_requests(served):
    client, _ = served
    before = client.get("/metrics").text
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")
    for name in ("calexec_time_to_first_token_seconds_count",
                 "calexec_time_per_output_token_seconds_count",
                 "calexec_job_queue_wait_seconds_count", "calexec_job_device_wait_seconds_count",
                 "calexec_job_h2d_seconds_count", "calexec_job_d2h_seconds_count",
                 "calexec_job_postprocess_seconds_count"):
        assert f"# TYPE {name.removesuffix('_count')} histogram" in before, name
    ttft0 = metric_value(before, "calexec_time_to_first_token_seconds_count") or 0
    bad0 = metric_value(before, "calexec_request_failures_total",
                        {"category": "invalid_request"}) or 0
    ok0 = metric_value(before, "calexec_request_success_total", {"finished_reason": "length"}) or 0
    assert complete(client, prompt=[7, 8], max_tokens=3).status_code == 200
    assert complete(client, prompt=[151936]).status_code == 400
    after = client.get("/metrics").text
    assert metric_value(after, "calexec_time_to_first_token_seconds_count") == ttft0 + 1
    assert metric_value(after, "calexec_request_failures_total",
                        {"category": "invalid_request", "raw": "none"}) == bad0 + 1
    assert metric_value(after, "calexec_request_success_total",
                        {"finished_reason": "length"}) == ok0 + 1
    assert metric_value(after, "calexec_job_device_wait_seconds_count", {"kind": "decode"}) >= 2
    assert metric_value(after, "calexec_lifecycle_state", {"state": "Ready"}) == 1
    assert metric_value(after, "calexec_lifecycle_state", {"state": "Failed"}) == 0
    assert metric_value(after, "calexec_generation") == 1
    assert metric_value(after, "calexec_buffer_slots", {"state": "Quarantined"}) == 0
    assert metric_value(after, "calexec_buffer_slots", {"state": "Free"}) > 0
    assert metric_value(after, "calexec_jobs_inflight") == 0
    assert metric_value(after, "calexec_executor_jobs_total", {"outcome": "succeeded"}) > 0


def test_failure_counter_carries_the_raw_calrt_code(fresh):
    executor, app = fresh()
    # DEVICE_BUSY on every try: the executor's bounded retries give up and the job fails
    Emulator(executor.device).set_fault(Fault.SUBMIT_RC, FaultMode.ALWAYS, 1, rc=17)
    with TestClient(app) as client:
        r = complete(client, prompt=[1, 2], max_tokens=2)
        assert r.status_code == 503 and r.json()["status"]["raw"] == 17
        text = client.get("/metrics").text
    assert metric_value(text, "calexec_request_failures_total",
                        {"category": "transient", "raw": "17"}) == 1


# ---- statecharts -------------------------------------------------------------------------------------
@pytest.mark.requires_tool("dot")
def test_statecharts_svg_highlights_the_lifecycle_state(served):
    client, _ = served
    r = client.get("/debug/statecharts/lifecycle.svg")
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml")
    assert SVG_ACTIVE.findall(r.text) == ["Ready"]
    page = client.get("/debug/statecharts")
    assert page.status_code == 200 and page.text.count("<svg") == 4
    assert "<b data-status='lifecycle'>Ready</b>" in page.text
    assert "/debug/statecharts/live.json" in page.text  # the page refreshes itself
    assert client.get("/debug/statecharts/nope.svg").status_code == 404


@pytest.mark.requires_tool("dot")
def test_live_job_counts_show_a_running_job(fresh):
    executor, app = fresh()
    Emulator(executor.device).set_latency(prefill_per_token_us=300_000, decode_us=300_000)
    seen: list[tuple[dict, list[str]]] = []
    with TestClient(app) as client:
        worker = threading.Thread(target=complete, args=(client,),
                                  kwargs={"prompt": [1], "max_tokens": 3})
        worker.start()

        def observed() -> bool:  # a /debug/jobs count and the job SVG taken while it runs
            jobs = client.get("/debug/jobs").json()["jobs"]
            seen.append((jobs, SVG_ACTIVE.findall(client.get("/debug/statecharts/job.svg").text)))
            return jobs["Submitted"] == 1 and seen[-1][1] == ["Submitted"]
        wait_for(observed, what="a submitted job in /debug/jobs and the job chart")
        worker.join(10)
    jobs, highlighted = seen[-1]
    assert sum(jobs.values()) == 1 and highlighted == ["Submitted"]
    assert app.state.service.live_job_counts() == dict.fromkeys(jobs, 0)


# ---- dump sink -----------------------------------------------------------------------------------------
def test_dump_sink_writes_no_prompt_text_by_default_and_respects_the_cap(fresh, tmp_path):
    executor = started_executor(tmp_path)
    try:
        sink = DumpSink(tmp_path / "dump", max_bytes=10_000)
        app = create_app(executor, ServerConfig(), sink)
        with TestClient(app) as client:
            assert complete(client, prompt="SECRET-PROMPT", max_tokens=2).status_code == 200
        record = json.loads(sink.path.read_text())
        assert "SECRET" not in sink.path.read_text()
        assert "prompt_token_ids" not in record and "text" not in record
        assert record["prompt_tokens"] == len("SECRET-PROMPT") and record["completion_tokens"] == 2
        size = sink.path.stat().st_size
        capped = DumpSink(tmp_path / "capped", max_bytes=size + size // 2)
        app = create_app(executor, ServerConfig(), capped)
        with TestClient(app) as client:
            for _ in range(3):
                assert complete(client, prompt="SECRET-PROMPT", max_tokens=2).status_code == 200
        assert capped.records == 1 and capped.dropped == 2
        assert capped.path.stat().st_size <= capped.max_bytes
    finally:
        executor.shutdown(5.0)


def test_a_dump_record_names_the_x_request_id_its_response_carried(tmp_path):
    """Every response carries ``x-request-id`` (the body's id, or the client's own); the dump
    record of the request had only the server's internal integer id, so a request a client
    quotes by that id could not be found in the dump. Each record names it, for a whole
    answer, a stream, each choice of ``n`` > 1, and the client's own id."""
    executor = started_executor(tmp_path)
    try:
        sink = DumpSink(tmp_path / "dump", max_bytes=100_000)
        app = create_app(executor, ServerConfig(), sink)
        with TestClient(app) as client:
            sent = []
            r = complete(client, prompt="a", max_tokens=2)
            sent.append(r.headers["x-request-id"])
            r = client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2,
                                                     "stream": True})
            assert r.status_code == 200
            sent.append(r.headers["x-request-id"])
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "c"}], "max_tokens": 2, "n": 2})
            assert r.status_code == 200 and r.headers["x-request-id"] == r.json()["id"]
            sent += [r.headers["x-request-id"]] * 2
            r = client.post("/v1/completions", json={"prompt": "d", "max_tokens": 2},
                            headers={"X-Request-Id": "trace-7"})
            sent.append(r.headers["x-request-id"])
        assert sent[0].startswith("cmpl-") and sent[-1] == "trace-7"
        records = [json.loads(line) for line in sink.path.read_text().splitlines()]
        assert sorted(record["x_request_id"] for record in records) == sorted(sent)
    finally:
        executor.shutdown(5.0)


def test_dump_sink_writes_content_only_when_allowed(tmp_path):
    sink = DumpSink(tmp_path, max_bytes=1000, include_content=True)
    sink.write({"prompt_token_ids": [1, 2], "text": "hi", "n": 1})
    assert json.loads(sink.path.read_text()) == {"prompt_token_ids": [1, 2], "text": "hi", "n": 1}


@pytest.mark.parametrize("broken", ["removed", "replaced_by_a_file"])
def test_a_dump_dir_that_becomes_unwritable_never_breaks_a_request(tmp_path, caplog, broken):
    """``serve --dump-dir``: the directory is removed (or a file takes its place) while the
    server runs. Plain and streamed requests still answer 200 with the oracle's tokens; each
    refused record is counted in ``DumpSink.errors``; one warning names the file and errno,
    nothing is logged at ERROR. Before the fix ``DumpSink.write`` raised the OSError at the
    end of every request: ``finish`` caught it as an internal error and logged a traceback
    ("recording request N") per request, uncounted. A directory back in place is written to
    again. (Removal, not chmod: the tests may run as root.)"""
    import shutil

    executor = started_executor(tmp_path)
    directory = tmp_path / "dump"
    sink = DumpSink(directory, max_bytes=1 << 20)
    try:
        app = create_app(executor, ServerConfig(), sink)
        with TestClient(app) as client:
            assert complete(client, prompt=[5, 6, 7], max_tokens=2).status_code == 200
            assert sink.flush(10)  # (the sink's writer thread appends the records)
            assert sink.records == 1
            shutil.rmtree(directory)
            if broken == "replaced_by_a_file":
                directory.write_text("not a directory")
            with caplog.at_level(logging.WARNING):
                for _ in range(2):
                    r = complete(client, prompt=[5, 6, 7], max_tokens=3)
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["token_ids"] == oracle_tokens([5, 6, 7], 3)
                with client.stream("POST", "/v1/completions", json={
                        "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}) as s:
                    lines = [line for line in s.iter_lines() if line]
                assert s.status_code == 200 and lines[-1] == "data: [DONE]", lines[-2:]
                assert sink.flush(10)
            errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records
                      if r.levelno >= logging.ERROR]
            assert errors == [], errors
            assert sink.errors == 3 and sink.records == 1, (sink.errors, sink.records)
            warnings = [r.getMessage() for r in caplog.records if r.name == "calexec.dump"]
            assert len(warnings) == 1, warnings  # one line per streak, not one per request
            code = "ENOENT" if broken == "removed" else "ENOTDIR"
            assert str(sink.path) in warnings[0] and code in warnings[0], warnings
            if broken == "replaced_by_a_file":
                directory.unlink()
            directory.mkdir()
            assert complete(client, prompt=[5, 6, 7], max_tokens=2).status_code == 200
            assert sink.flush(10)
            assert sink.records == 2 and sink.errors == 3
            assert len(sink.path.read_text().splitlines()) == 1
            # and a scrape says so: a dump that stops writing is seen without reading logs
            metrics = client.get("/metrics").text
            counts = {outcome: metric_value(metrics, "calexec_dump_records_total",
                                            {"outcome": outcome})
                      for outcome in ("written", "dropped", "error")}
            assert counts == {"written": 2.0, "dropped": 0.0, "error": 3.0}, counts
    finally:
        executor.shutdown(5.0)


def test_a_server_without_a_dump_exports_no_dump_metric(tmp_path):
    executor = started_executor(tmp_path)
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            assert "calexec_dump_records" not in client.get("/metrics").text
    finally:
        executor.shutdown(5.0)


def test_dump_sink_write_returns_false_when_the_file_system_refuses_the_record(tmp_path):
    """The library half: ``write`` never raises an OSError (before the fix it did), the
    record is counted in ``errors`` and nothing of it stays in the file."""
    sink = DumpSink(tmp_path / "d", max_bytes=1000)
    assert sink.write({"n": 1})
    sink.path.unlink()
    sink.path.mkdir()  # the file's name is now a directory: open() fails (root too)
    assert sink.write({"n": 2}) is False and sink.write({"n": 3}) is False
    assert sink.errors == 2 and sink.records == 1 and sink.dropped == 0


@pytest.mark.parametrize("directory", ["", "relative/dir", "/root/calexec-dump", "/home/u/d"])
def test_dump_sink_refuses_missing_relative_and_home_paths(directory):
    with pytest.raises(DumpConfigError):
        DumpSink(directory, max_bytes=1000)


# ---- tokenizer -----------------------------------------------------------------------------------------
def test_tokenizer_round_trip_and_incremental_decode():
    text = "a€b"
    ids = tokenizer.encode(text)
    assert ids == [tokenizer.BYTE_OFFSET + b for b in text.encode()]
    assert tokenizer.decode(ids) == text
    mixed = ids[:2] + [7] + ids[2:] + [151000]  # '€' split by a non-byte id
    detok = tokenizer.Detokenizer()
    streamed = "".join(detok.feed(t) for t in mixed) + detok.flush()
    assert streamed == tokenizer.decode(mixed) == "a\ufffd<7>\ufffd\ufffdb<151000>"


def test_requests_do_not_leak_sequences(served):
    client, service = served
    for i in range(5):
        assert complete(client, prompt=[i + 1], max_tokens=2).status_code == 200
    assert service.sequences.in_use == 0 and service.active == 0
