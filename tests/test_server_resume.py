"""Issue 16: resumable generations (drivers/serving/resume.py): a retryable or device-side failure of a
request's job costs the client latency, not an error.

Real executor on the bundled emulator, loopback servers only, faults injected through the
emulator's fault points (as in tests/test_chaos.py). Every wait is a bounded poll of a
condition; nothing asserts a duration.
"""

from __future__ import annotations

import json
import threading
import time
import types

import anyio
import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from calexec.contracts.errors import Category  # noqa: E402
from calexec.contracts.status import Phase, Status  # noqa: E402
from calexec.contracts.types import TaskKind  # noqa: E402
from calexec.drivers.calrt.runtime import Fault, FaultMode, Stage  # noqa: E402
from calexec.drivers.serving.resume import Resumer  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.drivers.tools.chaos import FAULTS  # noqa: E402
from calexec.machines.faults import RecoveryPolicy  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    busy_engine,
    metric_value,
    oracle_tokens,
    started_executor,
    stepped_server,
    wait_for,
)

PROMPT = [5, 6, 7]
#: the emulator's job-level faults whose §8 category is retryable or device-side
RESUMABLE_FAULTS = ["ccu_exception", "output_nan", "output_inf", "output_short", "wait_rc",
                    "submit_busy", "submit_unavailable", "hang", "hang_stale"]


#: the faults whose job never ends: only the execution deadline ends it
HANGS = ("hang", "hang_stale")


def fault_executor(tmp_path, device_config: str = "", hang: bool = False):
    """No escalation; with ``hang`` a short execution deadline (a hung job recovers in about
    a second), else the default: a healthy job a loaded host held past 1 s was one more
    fault, one more resume than the tests that count them expect."""
    short = {"execution_timeout_s": 1.0, "timeout_grace_s": 0.2} if hang else {}
    return started_executor(tmp_path, device_config, **short,
                            recovery=RecoveryPolicy(max_recoveries=1000, drain_grace_s=1.0))


def arm(emu, action: str, nth: int, mode=FaultMode.NTH) -> None:
    _, point, rc = next(f for f in FAULTS if f[0] == action)
    for name in point.split("+"):
        assert emu.set_fault(Fault[name], mode, nth, 0, rc) == 0


def stream_tokens(response) -> tuple[list[int], str | None, list[dict]]:
    tokens, ended, events = [], None, []
    for line in response.iter_lines():
        if not line:
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            ended = "done"
            continue
        event = json.loads(data)
        events.append(event)
        if "error" in event:
            ended = "error"
        else:
            tokens += event["choices"][0]["token_ids"]
    return tokens, ended, events


# ---- resumable generations ----------------------------------------------------------------------
@pytest.mark.parametrize("action", RESUMABLE_FAULTS)
@pytest.mark.parametrize("nth", [1, 4])  # the prefill, a decode after tokens were produced
def test_a_retryable_fault_is_resumed_with_identical_tokens(tmp_path, action, nth):
    executor = fault_executor(tmp_path, hang=action in HANGS)
    app = create_app(executor, ServerConfig())
    try:
        with TestClient(app) as client:
            arm(executor.device.emu, action, nth)
            r = client.post("/v1/completions",
                            json={"prompt": PROMPT, "max_tokens": 8, "timeout": 20})
            executor.device.emu.clear_all_faults()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 8)
            metrics = client.get("/metrics").text
        resumes = sum(metric_value(metrics, "calexec_resumes_total", {"cause": cause}) or 0
                      for cause in ("device", "internal", "transient", "unknown", "lifecycle",
                                    "unavailable", "generation_replaced"))
        if action == "submit_busy":  # §8 RETRY_QUEUED: the executor's own re-queue absorbs it
            assert executor.snapshot()["submit_retries"] >= 1
            return
        assert resumes >= 1
        # prompt (+ the tokens produced before a decode failed) re-prefilled
        assert metric_value(metrics, "calexec_resumed_tokens_reprefilled_total") >= len(PROMPT)
        assert metric_value(metrics, "calexec_resume_lost_seconds_count") == resumes
        assert metric_value(metrics, "calexec_request_failures_total") is None
        service = app.state.service
        wait_for(lambda: service.sequences.in_use == 0, what="every id back")
        assert service.sequences.consistent() and service.sequences.withheld == 0
    finally:
        executor.shutdown(5.0)


def test_a_stream_pauses_across_a_device_fault_and_continues_identically(tmp_path):
    """The CCU exception hits a decode after tokens were streamed: the same SSE connection
    carries the rest, token for token what a fault-free run sends, then [DONE]."""
    executor = fault_executor(tmp_path, "decode_us=20000")
    emu = executor.device.emu
    app = create_app(executor, ServerConfig())
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions",
                             json={"prompt": PROMPT, "max_tokens": 24, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                head = []
                for line in lines:  # the first 3 tokens, then the next job faults
                    if line:
                        head.append(json.loads(line[len("data: "):]))
                    if len(head) == 3:
                        break
                arm(emu, "ccu_exception", 1)
                rest_tokens, ended, _ = stream_tokens(_Lines(lines))
            emu.clear_all_faults()
            tokens = [t for event in head for t in event["choices"][0]["token_ids"]] + rest_tokens
            assert ended == "done"
            assert tokens == oracle_tokens(PROMPT, 24)
            assert executor.recoveries and executor.recoveries[-1]["ok"]
            metrics = http.get("/metrics").text
        assert metric_value(metrics, "calexec_resumes_total", {"cause": "device"}) == 1
        # re-prefilled: the prompt and the (at least 3) tokens produced before the fault
        assert metric_value(metrics, "calexec_resumed_tokens_reprefilled_total") >= len(PROMPT) + 3
    finally:
        emu.clear_all_faults()
        executor.shutdown(5.0)


class _Lines:
    """Wraps a started ``iter_lines`` iterator for :func:`stream_tokens`."""

    def __init__(self, lines) -> None:
        self.lines = lines

    def iter_lines(self):
        return self.lines


def test_past_the_resume_budget_the_client_gets_todays_error(tmp_path):
    """The prefill faults, and so does its re-prefill once the device is Ready again (the
    fault is re-armed then, so the recovery's golden is spared): one resume (max_resumes=1),
    then the error of old (500 internal)."""
    executor = fault_executor(tmp_path)
    app = create_app(executor, ServerConfig(max_resumes=1))
    resumer = app.state.service.resumer
    take_sequence = resumer.take_sequence

    async def rearmed(run):
        status = await take_sequence(run)
        if run.resumes:
            arm(executor.device.emu, "output_nan", 1)
        return status
    resumer.take_sequence = rearmed
    try:
        with TestClient(app) as client:
            arm(executor.device.emu, "output_nan", 1)
            r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            executor.device.emu.clear_all_faults()
            assert r.status_code == 500, r.text  # INTERNAL, as without resumes
            assert r.json()["status"]["category"] == "internal"
            metrics = client.get("/metrics").text
        assert metric_value(metrics, "calexec_resumes_total", {"cause": "internal"}) == 1
        assert metric_value(metrics, "calexec_resume_budget_exhausted_total") == 1
        service = app.state.service
        wait_for(lambda: service.sequences.in_use == 0 and service.releases_pending == 0,
                 what="every id back")
        assert service.sequences.consistent() and service.sequences.withheld == 0
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("action", ["unknown_csr", "slice_fail"])
def test_artifact_failures_are_not_resumed(tmp_path, action):
    executor = fault_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    try:
        with TestClient(app) as client:
            arm(executor.device.emu, action, 1)
            r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            executor.device.emu.clear_all_faults()
            assert r.status_code == 500, r.text
            assert r.json()["status"]["category"] in ("artifact", "request_artifact")
            metrics = client.get("/metrics").text
        assert metric_value(metrics, "calexec_resumes_total") is None
    finally:
        executor.shutdown(5.0)


def test_the_clients_own_deadline_is_not_resumed(tmp_path):
    executor = fault_executor(tmp_path, "decode_us=300000")
    app = create_app(executor, ServerConfig())
    try:
        with TestClient(app) as client:
            r = client.post("/v1/completions",
                            json={"prompt": PROMPT, "max_tokens": 4, "timeout": 0.1})
            assert r.status_code == 504, r.text
            assert metric_value(client.get("/metrics").text, "calexec_resumes_total") is None
    finally:
        executor.shutdown(5.0)


# ---- waiting through a recovery ------------------------------------------------------------------
def test_requests_wait_through_a_recovery_and_complete(tmp_path):
    """The stepped emulator holds the recovery's golden in Warming: the faulted request (its
    resume) and a request arriving then both wait (num_requests_waiting 2), /ready stays 503;
    once Ready both complete with the fault-free tokens."""
    out: dict[str, httpx.Response] = {}

    def post(name: str) -> None:
        out[name] = httpx.post(f"{server.url}/v1/completions", timeout=30,
                               json={"prompt": PROMPT, "max_tokens": 4})
    with stepped_server(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        with httpx.Client(base_url=server.url, timeout=20) as client:
            assert emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0) == 0
            assert emu.set_stepped(True) == 0
            faulted = threading.Thread(target=post, args=("faulted",))
            faulted.start()
            wait_for(lambda: busy_engine(emu) is not None, what="the prefill on the device")
            assert emu.step(busy_engine(emu), Stage.JOB)[0] == 0  # CCU exception -> recovery
            wait_for(lambda: executor.state == "Warming" and busy_engine(emu) is not None,
                     what="the recovery's golden held on the stepped device")
            late = threading.Thread(target=post, args=("late",))
            late.start()
            wait_for(lambda: service.admission.waiting == 2, what="both requests waiting")
            assert metric_value(client.get("/metrics").text,
                                "calexec_num_requests_waiting") == 2
            not_ready = client.get("/ready")
            assert not_ready.status_code == 503 and not_ready.headers["retry-after"]
            assert emu.set_stepped(False) == 0
            faulted.join(30)
            late.join(30)
            for name in ("faulted", "late"):
                assert out[name].status_code == 200, out[name].text
                assert out[name].json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 4)
            assert client.get("/ready").status_code == 200
            metrics = client.get("/metrics").text
        assert metric_value(metrics, "calexec_resumes_total", {"cause": "device"}) == 1
        assert metric_value(metrics, "calexec_num_requests_waiting") == 0
        assert metric_value(metrics, "calexec_request_failures_total") is None


def test_a_resume_waits_no_longer_than_its_time_budget(tmp_path):
    """The recovery's golden is held in Warming longer than resume_budget_s: the resume gives
    up at its budget with the failure of old (503 device), the deadline still far."""
    out: list[httpx.Response] = []
    with stepped_server(tmp_path, resume_budget_s=0.2) as (server, service, executor):
        emu = executor.device.emu
        with httpx.Client(base_url=server.url, timeout=20) as client:
            assert emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0) == 0
            assert emu.set_stepped(True) == 0
            faulted = threading.Thread(target=lambda: out.append(httpx.post(
                f"{server.url}/v1/completions", timeout=30,
                json={"prompt": PROMPT, "max_tokens": 2, "timeout": 30})))
            faulted.start()
            wait_for(lambda: busy_engine(emu) is not None, what="the prefill on the device")
            assert emu.step(busy_engine(emu), Stage.JOB)[0] == 0
            faulted.join(20)  # the golden stays held: only the budget can end the wait
            assert out and out[0].status_code == 503, out
            assert out[0].json()["status"]["category"] == "device"
            assert executor.state == "Warming"
            metrics = client.get("/metrics").text
            assert metric_value(metrics, "calexec_resumes_total", {"cause": "device"}) == 1
            assert metric_value(metrics, "calexec_resume_budget_exhausted_total") == 1
            assert emu.set_stepped(False) == 0
            wait_for(lambda: client.get("/ready").status_code == 200, timeout=20,
                     what="Ready after the recovery")


def test_a_model_switch_between_two_tokens_is_resumed(tmp_path):
    """A reload (the same model at another path) replaces the generation while a request
    decodes: its KV died with the old generation; it resumes on the new one, same tokens."""
    executor = started_executor(tmp_path, "decode_us=20000")
    copy = tmp_path / "copy.calbin"
    copy.write_bytes((tmp_path / "synthetic.calbin").read_bytes())
    app = create_app(executor, ServerConfig(admin_token="t"))
    out: list[httpx.Response] = []
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=20) as client:
            worker = threading.Thread(target=lambda: out.append(httpx.post(
                f"{server.url}/v1/completions", timeout=30,
                json={"prompt": PROMPT, "max_tokens": 30})))
            worker.start()
            wait_for(lambda: executor.snapshot()["succeeded"] >= 4, what="a few tokens")
            r = client.post("/admin/reload", json={"calbin": str(copy)},
                            headers={"Authorization": "Bearer t"})
            assert r.status_code == 200, r.text
            worker.join(30)
            assert out[0].status_code == 200, out[0].text
            assert out[0].json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 30)
            metrics = client.get("/metrics").text
        resumes = sum(metric_value(metrics, "calexec_resumes_total", {"cause": c}) or 0
                      for c in ("generation_replaced", "unavailable", "lifecycle"))
        assert resumes >= 1
    finally:
        executor.shutdown(5.0)


def test_a_resume_re_prefills_up_to_max_seq_tokens(tmp_path):
    """The longest request the server accepts (prompt + max_tokens = max_seq): a decode near
    the end faults and the re-prefill carries prompt + produced tokens, close to max_seq, in
    one PREFILL_IDS job (the prefill submodel takes max_seq tokens; inputs are sliced, not
    tiled into jobs). The tokens equal a fault-free run's."""
    executor = fault_executor(tmp_path)
    max_seq = executor.generation.submodels[TaskKind.DECODE].max_seq
    assert executor.generation.submodels[TaskKind.PREFILL_IDS].max_seq == max_seq
    prompt = [(i * 7919) % 150000 + 1 for i in range(max_seq - 6)]
    app = create_app(executor, ServerConfig())
    body = {"prompt": prompt, "max_tokens": 6, "timeout": 60}
    try:
        with TestClient(app) as client:
            reference = client.post("/v1/completions", json=body)
            assert reference.status_code == 200, reference.text
            arm(executor.device.emu, "ccu_exception", 5)  # the 4th decode
            r = client.post("/v1/completions", json=body)
            executor.device.emu.clear_all_faults()
            assert r.status_code == 200, r.text
            tokens = r.json()["choices"][0]["token_ids"]
            assert tokens == reference.json()["choices"][0]["token_ids"] and len(tokens) == 6
            metrics = client.get("/metrics").text
        # one resume; its cause is the fault's (device) when the loop meets the failed step,
        # or generation_replaced when the step was fired ahead and the recovery had already
        # replaced the generation when the loop came for it (timing: either is right)
        causes = {cause: metric_value(metrics, "calexec_resumes_total", {"cause": cause}) or 0
                  for cause in ("device", "generation_replaced", "unavailable", "internal",
                                "transient")}
        assert causes["device"] + causes["generation_replaced"] == 1 == sum(causes.values()), \
            causes
        assert metric_value(metrics, "calexec_resumed_tokens_reprefilled_total") \
            == len(prompt) + 4
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_sampling_resumes_with_identical_tokens(tmp_path, stream):
    """Sampling is a pure function of (logits, params, seed, token index): a request sampled
    with a seed, faulted on a decode and resumed, sends exactly the fault-free run's tokens."""
    executor = fault_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 2.0, "seed": 1234,
            "timeout": 20}

    def tokens_of(client) -> list[int]:
        if not stream:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            tokens, ended, _ = stream_tokens(r)
        assert ended == "done"
        return tokens
    try:
        with TestClient(app) as client:
            reference = tokens_of(client)
            assert reference != oracle_tokens(PROMPT, 10)  # sampled, not greedy
            arm(executor.device.emu, "ccu_exception", 5)
            resumed = tokens_of(client)
            executor.device.emu.clear_all_faults()
            metrics = client.get("/metrics").text
        assert resumed == reference
        assert metric_value(metrics, "calexec_resumes_total", {"cause": "device"}) == 1
    finally:
        executor.shutdown(5.0)


# ---- the resume decision itself (hand mutants of resume.py the tests above let through) ---------
def _resumer(max_resumes: int = 2, budget_s: float = 10.0):
    """A :class:`Resumer` on a stand-in service: its config, its metrics registry, an admission
    queue answering a fresh id at once, and the release path recording what it freed."""
    freed: list[int] = []

    async def in_worker(fn, *args):  # (the service's threads: the call itself will do here)
        return fn(*args)
    service = types.SimpleNamespace(
        in_worker=in_worker,
        config=types.SimpleNamespace(max_resumes=max_resumes, resume_budget_s=budget_s),
        metrics=types.SimpleNamespace(registry=CollectorRegistry()),
        admission=types.SimpleNamespace(try_admit=lambda resume: 9),
        release_now=lambda seq_id: freed.append(seq_id) is None,
        release_later=lambda old: freed.append(old.seq_id))
    return Resumer(service), service.metrics.registry, freed


def _run(**given):
    fields = dict(abandoned=False, resumes=0, resume_s=0.0, resume_started=None,
                  deadline=time.monotonic() + 60, seq_id=3, handle=None, enqueue_idle=None,
                  request_id=1, decode=None, generation_id=1, past=4, reprefill=False,
                  resume_cause=None, resume_failure=None, waiter=None)
    return types.SimpleNamespace(**{**fields, **given})


INTERNAL = Status.failure("request.output_nan", Category.INTERNAL, Phase.OUTPUT_CHECK, "nan")


@pytest.mark.parametrize("case, run, max_resumes, goes_on, exhausted", [
    ("an INTERNAL failure resumes", {}, 2, True, 0),
    ("--max-resumes 0: resumes are off, no budget was spent", {}, 0, False, 0),
    ("the last resume was spent", {"resumes": 2}, 2, False, 1),
    ("one resume left", {"resumes": 1}, 2, True, 0),
    ("the time budget was spent", {"resume_s": 10.0}, 2, False, 1),
    ("the request's deadline passed", {"deadline": 0.0}, 2, False, 0),
    ("the client left", {"abandoned": True}, 2, False, 0),
])
def test_what_is_resumed_and_what_spends_the_budget(case, run, max_resumes, goes_on, exhausted):
    resumer, registry, freed = _resumer(max_resumes)
    run = _run(**run)
    assert anyio.run(resumer.resume, run, INTERNAL) is goes_on, case
    assert registry.get_sample_value("calexec_resume_budget_exhausted_total") == exhausted, case
    if goes_on:  # the failed sequence is released, the fresh one is the admission's answer
        assert freed == [3] and run.seq_id is None and run.waiter == 9 and run.reprefill
        assert run.resume_cause == "internal" and run.resume_failure is INTERNAL
        assert registry.get_sample_value("calexec_resumes_total", {"cause": "internal"}) == 1
    else:
        assert freed == [] and run.seq_id == 3


def test_a_resume_re_prefills_the_prompt_and_the_tokens_produced():
    resumer, registry, _ = _resumer()
    run = _run(reprefill=True, prompt=[5, 6, 7], tokens=[1, 2], resume_cause="device",
               resume_started=time.monotonic())
    resumer.resumed(run)
    assert registry.get_sample_value("calexec_resumed_tokens_reprefilled_total") == 5
    assert run.resume_started is None and not run.reprefill


def test_only_a_resume_wait_cut_short_by_its_time_budget_counts_as_budget_exhausted():
    """``take_sequence``: a resume that stops waiting for a fresh sequence ends with the
    failure it resumed from; ``calexec_resume_budget_exhausted_total`` counts it only when
    the resume's time budget, not the request's own deadline, cut the wait."""
    resumer, registry, _ = _resumer()

    async def deadline_passed(run, until):
        return Status.deadline(Phase.ADMISSION, "deadline passed")
    resumer.service.admission.take = deadline_passed
    now = time.monotonic()
    own = _run(deadline=now - 1, resume_started=now - 2, resume_failure=INTERNAL)
    assert anyio.run(resumer.take_sequence, own) is INTERNAL
    assert registry.get_sample_value("calexec_resume_budget_exhausted_total") == 0
    budget = _run(deadline=now + 60, resume_started=now - 2, resume_failure=INTERNAL)
    assert anyio.run(resumer.take_sequence, budget) is INTERNAL
    assert registry.get_sample_value("calexec_resume_budget_exhausted_total") == 1


SWITCH_PROMPT = [3, 1, 4, 1, 5]


def test_without_resumes_a_generation_replaced_between_two_jobs_is_a_503_to_retry(
        tmp_path, monkeypatch):
    """``--max-resumes 0``: a model switch between two jobs of a request ends it with 503
    UNAVAILABLE naming the replaced generation (retry), the same answer a resume would
    have avoided. Its next job, admitted on the new generation, is refused there for a
    ``past_len`` the new KV never held (400 ``kv.past_len_beyond_committed``): that refusal
    is the server's generation change, never the client's request (found by a hand mutant
    of ``_generation_moved``, helper srvmut, stop 47)."""
    executor = started_executor(tmp_path)
    copy = tmp_path / "copy.calbin"
    copy.write_bytes((tmp_path / "synthetic.calbin").read_bytes())
    enqueue, calls, switched = executor.enqueue, [], []

    def switching_enqueue(request, *args, **kwargs):
        calls.append(request.past_len)
        if len(calls) == 3:  # after two tokens: the generation is replaced, then the job goes
            switched.append(executor.switch_model(str(copy)))
        return enqueue(request, *args, **kwargs)

    monkeypatch.setattr(executor, "enqueue", switching_enqueue)
    app = create_app(executor, ServerConfig(max_resumes=0, prearm=False, decode_bursts=False))
    try:
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": SWITCH_PROMPT, "max_tokens": 6})
            assert switched and switched[0].ok, switched
            assert r.status_code == 503, r.text
            status = r.json()["status"]
            assert status["category"] == "unavailable", status
            assert "was replaced by" in status["message"], status
    finally:
        executor.shutdown(5.0)
