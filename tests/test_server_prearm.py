"""The server decodes through the executor's pre-armed decode stream (issue 17): the tokens
are the ones one enqueue per token gives, steps really are pre-armed, and every way a request
ends (length, client gone mid-stream) releases the armed job and the sequence."""

from __future__ import annotations

import json
import threading
import types

import pytest
from fastapi.testclient import TestClient

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import metric_value, oracle_tokens, started_executor, wait_for

#: a 2 ms decode: the submitter has the time to arm the next job while one runs
DEVICE = "decode_us=2000"


@pytest.fixture
def make(tmp_path):
    made = []

    def build(native_relay=False, **config):
        executor = started_executor(tmp_path, DEVICE, native_relay=native_relay)
        made.append(executor)
        return executor, create_app(executor, ServerConfig(**config))
    yield build
    for executor in made:
        executor.shutdown(5.0)


def settled(executor, service) -> bool:
    snap = executor.snapshot()
    return (service.sequences.in_use == 0 and not executor.dispatch.armed_jobs() and snap["inflight"] == 0
            and service.sequences.consistent())


@pytest.mark.parametrize("prompt", [[5, 6, 7, 8], list(range(100, 140))])
def test_prearmed_decode_gives_the_tokens_of_one_enqueue_per_token(make, prompt):
    tokens = {}
    for prearm in (True, False):
        executor, app = make(prearm=prearm)
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12})
            assert r.status_code == 200, r.text
            tokens[prearm] = r.json()["choices"][0]["token_ids"]
            text = client.get("/metrics").text
            fired = metric_value(text, "calexec_decode_steps_total", {"prearmed": "true"}) or 0
            admitted = metric_value(text, "calexec_decode_steps_total",
                                    {"prearmed": "false"}) or 0
            service = app.state.service
            wait_for(lambda: settled(executor, service), what="sequence and armed job released")
        if prearm:
            assert fired + admitted == 11  # 12 tokens: one from the prefill, 11 decode steps
            assert fired >= 1, "no step was pre-armed"
        else:
            assert fired == admitted == 0
    assert tokens[True] == tokens[False] == oracle_tokens(prompt, 12)


def test_streaming_through_the_decode_stream_then_everything_is_free(make):
    executor, app = make()
    with TestClient(app) as client:
        with client.stream("POST", "/v1/completions",
                           json={"prompt": [9, 8, 7], "max_tokens": 8, "stream": True}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        ids = [t for e in events[:-1] for c in json.loads(e[6:]).get("choices", [])
               for t in c.get("token_ids", [])]
        assert events[-1] == "data: [DONE]" and ids == oracle_tokens([9, 8, 7], 8)
        service = app.state.service
        wait_for(lambda: settled(executor, service), what="sequence and armed job released")


def test_a_client_gone_mid_stream_releases_the_armed_job_and_the_sequence(make):
    executor, app = make()
    with TestClient(app) as client:
        with client.stream("POST", "/v1/completions",
                           json={"prompt": [1, 2, 3], "max_tokens": 2000, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 5:
                    break  # leave mid-generation: the server cancels and closes the stream
        service = app.state.service
        wait_for(lambda: settled(executor, service), timeout=20.0,
                 what="armed job and sequence released after the disconnect")
        # the server still serves, from the same sequence ids
        r = client.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == \
            oracle_tokens([4, 5], 3)


def test_a_sequence_busy_for_a_moment_is_released_not_withheld(make):
    """The background release retries ``kv.sequence_busy`` (bounded): a pre-armed job the
    submitter took back can still be mid-release when the stream's close() returns. Found by
    the chaos soak (an id withheld at idle); here the executor answers busy twice."""
    executor, app = make()
    service = app.state.service
    seq_id = service.sequences.acquire()
    answers = iter(["busy", "busy"])
    real = executor.release_sequence

    def flaky(seq, wait_s=0.0):
        if next(answers, None) == "busy":
            return Status.failure("kv.sequence_busy", Category.INVALID_REQUEST, Phase.ADMISSION,
                                  f"sequence {seq} is busy", seq_id=seq)
        return real(seq, wait_s)
    executor.release_sequence = flaky
    run = types.SimpleNamespace(seq_id=seq_id, handle=None, decode=None,
                                enqueue_idle=threading.Event())
    run.enqueue_idle.set()
    service.release_when_done(run)
    counts = service.sequences.counts()
    assert counts["withheld"] == counts["in_use"] == 0
    assert counts["free"] == counts["capacity"]


def test_h2d_and_d2h_histograms_hold_the_copies_the_device_measured(tmp_path):
    """#15 §4: the H2D/D2H histograms are filled from the device's own measurement (the
    emulator times its DMA stages; CalRT 0.7.6 gives the host no copy timing, so a vendor
    runtime leaves them empty rather than observing fake zeros). With a 300 us H2D and a
    500 us D2H profile every job's copies take at least that long."""
    executor = started_executor(tmp_path, "h2d_us=300;d2h_us=500")
    try:
        app = create_app(executor, ServerConfig())
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 4})
            assert r.status_code == 200, r.text
            text = client.get("/metrics").text
        for stage, floor in (("h2d", 300e-6), ("d2h", 500e-6)):
            for kind, jobs in (("prefill_ids", 1), ("decode", 3)):
                labels = {"kind": kind}
                count = metric_value(text, f"calexec_job_{stage}_seconds_count", labels)
                total = metric_value(text, f"calexec_job_{stage}_seconds_sum", labels)
                assert count == jobs, (stage, kind, count)
                assert total >= jobs * floor, (stage, kind, total)
        outbuf = executor.pool.slots[0].outbuf  # a runtime without the control answers None
        saved, outbuf.copy_control = outbuf.copy_control, None
        try:
            assert outbuf.copy_ms() is None
        finally:
            outbuf.copy_control = saved
    finally:
        executor.shutdown(5.0)


def test_greedy_ahead_same_tokens_fires_steps_and_a_stop_string_frees_everything(make):
    """Greedy requests decode with the completion thread firing each next step (greedy
    ahead): the tokens are those without it; a request a stop string ends early leaves its
    fired-ahead step cancelled and everything free; sampled requests never fire ahead."""
    prompt, n = [11, 12, 13, 14], 12
    tokens, ahead = {}, {}
    for on in (True, False):
        executor, app = make(greedy_ahead=on)
        with TestClient(app) as client:
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n})
            assert r.status_code == 200, r.text
            tokens[on] = r.json()["choices"][0]["token_ids"]
            ahead[on] = metric_value(client.get("/metrics").text,
                                     "calexec_decode_steps_ahead_total") or 0
            service = app.state.service
            wait_for(lambda: settled(executor, service), what="sequence and armed job released")
            if on:
                text = r.json()["choices"][0]["text"]
                stop = text[len(text) // 2:len(text) // 2 + 2]  # ends it mid-way
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                                         "stop": [stop]})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["finish_reason"] == "stop"
                wait_for(lambda: settled(executor, service),
                         what="fired-ahead step cancelled, sequence released")
                before = metric_value(client.get("/metrics").text,
                                      "calexec_decode_steps_ahead_total")
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n,
                                                         "temperature": 0.8, "seed": 3})
                assert r.status_code == 200, r.text
                assert metric_value(client.get("/metrics").text,
                                    "calexec_decode_steps_ahead_total") == before
                wait_for(lambda: settled(executor, service), what="sequence released")
    assert tokens[True] == tokens[False] == oracle_tokens(prompt, n)
    assert ahead[True] >= 1 and ahead[False] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_discarded_step_that_hangs_never_delays_the_answer(tmp_path, stream):
    """Issue 24 item 6. A greedy request ended by a stop string has all its tokens, but the
    step the completion thread fired ahead (token 3) hangs on the device until the execution
    deadline (5 s) ends it and a recovery resets the device. The answer (the whole body, for
    a stream) comes while that step still hangs: before the fix ``finish()`` closed the
    stream waiting for it (up to min(deadline, 10 s)), so the answer came after the step had
    ended (its slot quarantined). The sequence id comes back once the step ended and the
    server serves again."""
    import httpx

    from calexec.drivers.calrt.runtime import Fault, FaultMode
    from calexec.machines.faults import RecoveryPolicy
    from test_server_support import LiveServer

    executor = started_executor(tmp_path, "decode_us=50000", execution_timeout_s=5.0,
                                timeout_grace_s=0.2,
                                recovery=RecoveryPolicy(max_recoveries=100, drain_grace_s=1.0))
    emu = executor.device.emu
    app = create_app(executor, ServerConfig())
    service = app.state.service
    prompt = [5, 6, 7]
    greedy = oracle_tokens(prompt, 4)
    assert greedy[2] not in greedy[:2]
    body = {"prompt": prompt, "max_tokens": 8, "stop": f"<{greedy[2]}>", "timeout": 30,
            "stream": stream}
    try:
        with LiveServer(app) as server:
            # accepted jobs from now: 1 prefill (token 0), 2 and 3 decodes (tokens 1, 2), 4
            # the step fired ahead with token 2's argmax, which the stop string discards
            assert emu.set_fault(Fault.HANG, FaultMode.NTH, 4, 0, 0) == 0
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                              timeout=30) as r:
                lines = [line for line in r.iter_lines() if line]
            at_answer = executor.snapshot()
            assert r.status_code == 200, lines
            if stream:
                assert lines[-1] == "data: [DONE]", lines[-3:]
                events = [json.loads(line[6:]) for line in lines[:-1]]
                ids = [t for e in events for t in e["choices"][0]["token_ids"]]
                finish = events[-1]["choices"][0]["finish_reason"]
            else:
                choice = json.loads(lines[0])["choices"][0]
                ids, finish = choice["token_ids"], choice["finish_reason"]
            assert ids == greedy[:3] and finish == "stop"
            assert emu.fault_stats(Fault.HANG)[2] == 1  # the discarded step hangs
            # answered while it still hangs: not resolved yet, no recovery, id still held
            assert at_answer["quarantined"] == 0 and at_answer["recoveries"] == 0, at_answer
            assert service.sequences.in_use == 1
            wait_for(lambda: service.sequences.in_use == 0 and service.releases_pending == 0,
                     timeout=30, what="the id back once the hung step ended")
            counts = service.sequences.counts()
            assert counts["withheld"] == 0 and counts["free"] == counts["capacity"]
            assert executor.snapshot()["quarantined"] == 1  # it did end, on its own deadline
            wait_for(lambda: service.ready, timeout=30, what="Ready after the recovery")
            again = httpx.post(f"{server.url}/v1/completions", timeout=30,
                               json={"prompt": prompt, "max_tokens": 4})
            assert again.status_code == 200
            assert again.json()["choices"][0]["token_ids"] == greedy
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("stream", [False, True])
def test_the_native_relay_serves_the_same_tokens_and_infers_fired_steps_from_c(make, stream):
    """``serve --native-relay`` (ExecutorConfig.native_relay): the fired steps of a request
    (greedy ahead, pre-armed) reach infer() from the submitter's relay, counted in
    ``calexec_relay_submitted_total``, and the answer is the one without it."""
    prompt = list(range(40, 52))
    answers, relayed = {}, {}
    for native_relay in (False, True):
        executor, app = make(native_relay=native_relay)
        assert executor.relay_active is native_relay
        with TestClient(app) as client:
            body = {"prompt": prompt, "max_tokens": 16, "stream": stream}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            answers[native_relay] = (r.text if stream else r.json()["choices"][0]["token_ids"])
            relayed[native_relay] = metric_value(client.get("/metrics").text,
                                                 "calexec_relay_submitted_total")
            wait_for(lambda: settled(executor, app.state.service),
                     what="sequence and armed job released")
    if stream:  # the ids and timestamps of a stream differ: compare the tokens' text
        texts = {k: [json.loads(line[6:])["choices"][0]["text"] for line in v.splitlines()
                     if line.startswith("data: {")] for k, v in answers.items()}
        assert texts[True] == texts[False] and len(texts[True]) >= 16
    else:
        assert answers[True] == answers[False] == oracle_tokens(prompt, 16)
    assert relayed[False] == 0
    assert relayed[True] >= 1, "no step went to infer() from the relay"
