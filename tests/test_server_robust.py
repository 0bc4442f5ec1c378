"""Issue 13, the server's half: sequence ids owned above every generation's KvManager (defect
5), a refused reload under load (6), responses bounded by the request deadline, hung device or
not (4), KV admission without hold and wait (7), admin input validated before the lifecycle
moves (9). Real executor, real emulator (stepped where timing matters), loopback only, every
wait bounded."""

from __future__ import annotations

import json
import os
import threading

import anyio
import httpx
import pytest
from fastapi.testclient import TestClient

from calexec.drivers.calrt.runtime import Stage
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.synthetic import calbin as cb
from test_server_support import (
    LiveServer,
    metric_value,
    oracle_tokens,
    started_executor,
    wait_for,
    wait_serve_ready,
)

TOKEN = "robust-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class GatedLoads:
    """Wraps ``executor.device``: ``load_calbin(path)`` of the gated path waits until the test
    opens the gate, so a model switch stops at a chosen point of its teardown/rebuild."""

    def __init__(self, device, path: str) -> None:
        self._device = device
        self._path = path
        self.entered = threading.Event()
        self.gate = threading.Event()

    def load_calbin(self, path: str):
        if path == self._path:
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self._device.load_calbin(path)

    def __getattr__(self, name):
        return getattr(self._device, name)


def sequences_settled(service) -> bool:
    return (service.active == 0 and service.sequences.in_use == 0
            and getattr(service, "releases_pending", 0) == 0)


def assert_sequences_whole(service) -> None:
    """Every id free again, none withheld: free + in use + withheld = capacity."""
    seqs = service.sequences
    assert seqs.withheld == 0 and seqs.in_use == 0, (seqs.withheld, seqs.in_use)
    counts = seqs.counts()
    assert seqs.consistent() and counts["free"] == counts["capacity"], counts


@pytest.fixture
def corrupt(tmp_path):
    """Not a calbin: ``switch_model`` loads it, the runtime refuses it, the switch rolls back
    (over HTTP, ``check_calbin`` refuses it first: 400, nothing moves)."""
    path = tmp_path / "corrupt.calbin"
    path.write_bytes(b"not a calbin " * 16)
    return str(path)


@pytest.fixture
def unpinned(tmp_path):
    """A calbin that passes ``check_calbin`` (a good calbin of another model) but whose switch
    is refused at its golden (none pinned, ``allow_unpinned_golden`` off): the rollback path
    of a reload over HTTP."""
    path = tmp_path / "unpinned.calbin"
    cb.write(str(path), cb.default_spec(seed=cb.DEFAULT_SEED ^ 0x3C))
    return str(path)


# ---- defects 5 and 6: a request finishing while its generation is torn down ---------------------
@pytest.mark.parametrize("window", ["old_kv_destroyed", "no_generation"])
def test_a_request_finishing_during_a_refused_switch_gives_its_sequence_back(tmp_path, corrupt,
                                                                             window):
    """A refused reload of a corrupt calbin stops, gated, at one of two points: loading the new
    calbin (generation 1 is released, its KvManager destroyed, ``executor.kvc`` still names it)
    or loading the fallback after the refusal (``executor.kvc`` is None). A request whose last
    job ran on generation 1 finishes there. Before the fix: its release went to the destroyed
    KvManager (rc 4, the id withheld for ever) or raised AttributeError (the request stayed
    "running" and kept its id)."""
    executor = started_executor(tmp_path)
    try:
        # the request's resume waits for a Ready generation the gated switch withholds: a
        # second of budget (the default's 10 s only took longer) ends it with its 503
        app = create_app(executor, ServerConfig(admin_token=TOKEN, resume_budget_s=1.0))
        service = app.state.service
        gated = GatedLoads(executor.device,
                           corrupt if window == "old_kv_destroyed" else executor.gen.calbin_path)
        executor.device = gated

        async def first_token():
            run, status, _ = service.admit(_admission(prompt=[3, 4, 5], max_tokens=8))
            assert run is not None, status
            token = await service.advance(run)
            return run, token
        run, token = anyio.run(first_token)
        assert token == oracle_tokens([3, 4, 5], 1)[0]
        old = executor.gen
        switch: list = []
        switching = threading.Thread(target=lambda: switch.append(executor.switch_model(corrupt)))
        switching.start()
        assert gated.entered.wait(10)
        assert executor.state == "Configuring"
        assert old.kvc.closed  # generation 1 is torn down: its KvManager destroyed
        if window == "no_generation":
            assert executor.kvc is None

        async def finish():
            assert await service.advance(run) is None  # the next job is refused: 503
            await service.finish(run)
        anyio.run(finish)
        assert run.status is not None and run.status.http_status == 503, run.status
        wait_for(lambda: sequences_settled(service), what="the request to end and its id back")
        assert_sequences_whole(service)
        gated.gate.set()
        switching.join(20)
        assert switch and switch[0].code == "recovery.rolled_back", switch
        with TestClient(app) as client:
            assert client.get("/ready").status_code == 200
            r = client.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == \
                oracle_tokens([3, 4, 5], 4)
            wait_for(lambda: sequences_settled(service), what="ids back after the last request")
            assert_sequences_whole(service)
            metrics = client.get("/metrics").text  # the invariant, as exported
        values = {name: metric_value(metrics, f"calexec_kv_sequences_{name}")
                  for name in ("free", "in_use", "withheld", "capacity")}
        assert values == {"free": 32, "in_use": 0, "withheld": 0, "capacity": 32}, values
    finally:
        executor.shutdown(5.0)


def _admission(**fields):
    from calexec.drivers.serving.server import Admission
    return Admission(**fields)


@pytest.mark.parametrize("stream", [False, True])
def test_refused_reload_under_load_every_client_gets_a_json_error_or_sse_error(tmp_path, unpinned,
                                                                              stream):
    """Eight clients decoding (20 ms a token) while a calbin with no pinned golden is reloaded
    and refused
    (the fallback load held open for a while): every response is a completion, a JSON error
    body, or a stream ending with [DONE] or an SSE error event; nothing stays running; every
    id is free again; the previous model serves again."""
    executor = started_executor(tmp_path, "decode_us=20000")
    # the clients' resumes wait for a Ready generation the held fallback load withholds: a
    # second of budget (the default's 10 s only took longer) ends each with its error
    app = create_app(executor, ServerConfig(admin_token=TOKEN, resume_budget_s=1.0))
    service = app.state.service
    gated = GatedLoads(executor.device, executor.gen.calbin_path)
    executor.device = gated
    outcomes: list = []
    try:
        with LiveServer(app) as server:
            def client(i: int) -> None:
                body = {"prompt": [i + 1, i + 2], "max_tokens": 60, "stream": stream}
                try:
                    if not stream:
                        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
                        outcomes.append(("plain", r.status_code, r.json()))
                        return
                    with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                                      timeout=30) as r:
                        lines = [line for line in r.iter_lines() if line]
                        outcomes.append(("sse", r.status_code, lines))
                except Exception as err:  # noqa: BLE001 - recorded and asserted on below
                    outcomes.append(("exception", None, repr(err)))
            clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
            for t in clients:
                t.start()
            # every client's request admitted before the reload: one that came after the
            # switch began waited for Ready within its 30 s deadline, past this test's 20 s wait
            # for the answers (the order a loaded host gave; the job count alone let it pass)
            def admitted() -> float:
                return metric_value(service.metrics.exposition().decode(),
                                    "calexec_requests_total",
                                    {"stream": "true" if stream else "false"}) or 0.0
            wait_for(lambda: admitted() == 8 and executor.counters["succeeded"] >= 8 + 3,
                     what="every client admitted and decoding")
            reload: list = []
            reloading = threading.Thread(target=lambda: reload.append(httpx.post(
                f"{server.url}/admin/reload", json={"calbin": unpinned}, headers=AUTH,
                timeout=30)))
            reloading.start()
            assert gated.entered.wait(10)  # refused; the fallback's load is held
            assert executor.kvc is None
            wait_for(lambda: len(outcomes) == 8, timeout=20, what="every client answered")
            gated.gate.set()
            reloading.join(20)
            for t in clients:
                t.join(5)
            assert reload and reload[0].status_code == 500
            assert reload[0].json()["status"]["code"] == "recovery.rolled_back"
            assert httpx.get(f"{server.url}/ready", timeout=5).status_code == 200
        for kind, code, payload in outcomes:
            assert kind != "exception", payload
            if kind == "plain":
                assert code in (200, 503), (code, payload)
                assert "choices" in payload if code == 200 else payload["error"]["code"]
            elif code != 200:  # refused before the stream started: a JSON error body
                assert code == 503 and json.loads(payload[0])["error"]["code"], payload
            else:
                last = payload[-1]
                if last != "data: [DONE]":
                    assert json.loads(last[len("data: "):])["error"]["code"], payload[-2:]
        assert any(code != 200 or (kind == "sse" and payload[-1] != "data: [DONE]")
                   for kind, code, payload in outcomes), "the reload refused nobody"
        wait_for(lambda: sequences_settled(service), what="every request ended, ids back")
        assert_sequences_whole(service)
    finally:
        gated.gate.set()
        executor.shutdown(5.0)


# ---- defect 4 (HTTP half): the response never waits for a hung job -------------------------------
def test_a_hung_job_does_not_delay_the_504_and_its_sequence_waits_for_the_job(tmp_path):
    """The decode job is held on the (stepped) device. Before the fix the handler waited up to
    release_wait_s (60 s) for the job after the deadline before answering. Now the 504 comes
    at the deadline while the job is still on the device, and the sequence id is not reused
    before the job ended."""
    executor = started_executor(tmp_path)
    emu = executor.device.emu
    app = create_app(executor, ServerConfig(max_sequences=1))
    service = app.state.service
    try:
        with LiveServer(app) as server:
            assert emu.set_stepped(True) == 0
            answered: list = []
            worker = threading.Thread(target=lambda: answered.append(httpx.post(
                f"{server.url}/v1/completions", timeout=30,
                json={"prompt": [1, 2, 3], "max_tokens": 3, "timeout": 1.0})))
            worker.start()
            _step_one_job(emu)  # the prefill; the first decode is then held on the device
            wait_for(lambda: executor.snapshot()["inflight"] == 1 and _busy(emu) is not None,
                     what="the decode job held on the device")
            worker.join(15)
            assert answered, "no response while the job is held on the device"
            r = answered[0]
            assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
            assert _busy(emu) is not None  # answered while the job is still on the device
            assert service.sequences.in_use == 1  # ... and its id is not free before it ended
            # (issue 16: a request finding no free id waits for one until its deadline)
            refused = httpx.post(f"{server.url}/v1/completions", timeout=10,
                                 json={"prompt": [1], "max_tokens": 1, "timeout": 0.3})
            assert refused.status_code == 504, refused.text
            assert refused.json()["error"]["code"] == "admission.deadline"
            assert service.sequences.in_use == 1
            _step_one_job(emu)  # the job ends (its result discarded): the id comes back
            wait_for(lambda: sequences_settled(service), what="the id back after the job")
            assert_sequences_whole(service)
            assert emu.set_stepped(False) == 0
            ok = httpx.post(f"{server.url}/v1/completions", timeout=10,
                            json={"prompt": [1, 2, 3], "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == \
                oracle_tokens([1, 2, 3], 3)
    finally:
        emu.set_stepped(False)
        executor.shutdown(5.0)


def _busy(emu):
    return next((e for e in (0, 1) if emu.pending(e)[1] > 0), None)


def _step_one_job(emu) -> None:
    wait_for(lambda: _busy(emu) is not None, what="a job on the stepped device")
    rc, _ = emu.step(_busy(emu), Stage.JOB)
    assert rc == 0, rc


def test_ready_and_health_follow_executor_health(tmp_path):
    """``executor.health()`` (reasons the executor cannot serve) makes /ready 503 naming them,
    /health report them, completions wait (504 naming them at their deadline) and a reload is
    refused with the lifecycle unchanged."""
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token=TOKEN))
    reasons: list[str] = []
    executor.health = lambda: list(reasons)
    try:
        with TestClient(app) as client:
            assert client.get("/ready").status_code == 200
            health = client.get("/health").json()
            assert {k: health[k] for k in ("status", "reasons", "lifecycle")} == {
                "status": "ok", "reasons": [], "lifecycle": "Ready"}
            # §9.2 pin state and §8 disabled features are on /health too (issue 18)
            assert health["golden"] == "pinned" and health["disabled_features"] == []
            assert health["thread_faults"] == 0 and health["generation"] == 1
            reasons.append("job 12 on the device is 3.0s past its execution deadline")
            ready = client.get("/ready")
            assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
            assert "past its execution deadline" in ready.json()["error"]["message"]
            health = client.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert health.json()["reasons"] == reasons
            # issue 16: a completion waits (a hung job ends in a recovery), until its deadline
            r = client.post("/v1/completions",
                            json={"prompt": [1], "max_tokens": 1, "timeout": 0.2})
            assert r.status_code == 504 and "execution deadline" in r.json()["error"]["message"]
            r = client.post("/admin/reload", json={"calbin": executor.gen.calbin_path},
                            headers=AUTH)
            assert r.status_code == 503 and r.json()["error"]["param"] == "calbin"
            assert executor.state == "Ready" and executor.gen.id == 1  # lifecycle unchanged
            reasons.clear()
            assert client.get("/ready").status_code == 200
            assert client.post("/v1/completions",
                               json={"prompt": [1], "max_tokens": 1}).status_code == 200
    finally:
        executor.shutdown(5.0)


# ---- defect 7: KV admission without hold and wait ------------------------------------------------
KV6 = "kv_blocks=6;kv_block_size=16"  # 96 tokens; the 19-token golden fits


def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    out: list = [None] * len(bodies)

    def one(i: int) -> None:
        out[i] = httpx.post(f"{url}/v1/completions", json=bodies[i], timeout=60)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in out), "a client got no response"
    return out


def test_two_requests_that_each_fit_alone_both_complete_together(tmp_path):
    """6 blocks of 16 tokens; each request is 40 prompt + 30 new tokens (5 blocks). Before the
    fix each prefill held 3 blocks and both waited for the rest: 429 kv.deadline after the
    whole timeout. Now the second waits, holding nothing, for the first to finish."""
    executor = started_executor(tmp_path, KV6)
    app = create_app(executor, ServerConfig())
    try:
        with LiveServer(app) as server:
            prompts = [list(range(1, 41)), list(range(101, 141))]
            out = _post_all(server.url, [{"prompt": p, "max_tokens": 30, "timeout": 20}
                                         for p in prompts])
            for prompt, r in zip(prompts, out):
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["token_ids"] == oracle_tokens(prompt, 30)
        wait_for(lambda: sequences_settled(app.state.service), what="ids back")
        assert_sequences_whole(app.state.service)
    finally:
        executor.shutdown(5.0)


def test_64_requests_that_each_fit_alone_complete_or_get_a_clear_error(tmp_path):
    """64 such requests at once (32 sequence ids): every one completes (oracle tokens) or is
    refused at once with 429 kv.full; none waits to its deadline while holding KV."""
    executor = started_executor(tmp_path, KV6)
    app = create_app(executor, ServerConfig())
    try:
        with LiveServer(app) as server:
            prompts = [[(7 * i + j) % 5000 + 1 for j in range(40)] for i in range(64)]
            out = _post_all(server.url, [{"prompt": p, "max_tokens": 30, "timeout": 60}
                                         for p in prompts])
        codes = [r.status_code for r in out]
        assert set(codes) <= {200, 429}, [r.text for r in out if r.status_code not in (200, 429)]
        assert all(r.json()["error"]["code"] == "kv.full" for r in out if r.status_code == 429)
        assert codes.count(200) >= 32
        for prompt, r in zip(prompts, out):
            if r.status_code == 200:
                assert r.json()["choices"][0]["token_ids"] == oracle_tokens(prompt, 30)
        wait_for(lambda: sequences_settled(app.state.service), what="ids back")
        assert_sequences_whole(app.state.service)
    finally:
        executor.shutdown(5.0)


# ---- defect 9: admin input validated before the lifecycle moves ----------------------------------
@pytest.fixture
def admin(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token=TOKEN, max_calbin_bytes=1 << 20))
    with TestClient(app) as client:
        yield client, executor, app.state.service
    executor.shutdown(5.0)


def _bounded(fn, seconds: float = 10.0):
    """Run ``fn`` in a thread; fail (not hang) if it blocks: a FIFO or /dev/zero must not."""
    out: list = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, f"the call blocked for {seconds}s"
    return out[0]


@pytest.mark.parametrize("case", ["nul", "dev_zero", "fifo", "directory", "empty", "missing",
                                  "too_large", "not_a_string", "too_long"])
def test_reload_refuses_bad_paths_with_400_and_the_lifecycle_unchanged(admin, tmp_path, case):
    client, executor, _ = admin
    if case == "fifo":
        os.mkfifo(tmp_path / "pipe.calbin")
    big = tmp_path / "big.calbin"
    if case == "too_large":
        big.write_bytes(b"\0" * ((1 << 20) + 1))
    empty = tmp_path / "empty.calbin"
    empty.write_bytes(b"")
    path = {"nul": executor.gen.calbin_path + "\0.calbin", "dev_zero": "/dev/zero",
            "fifo": str(tmp_path / "pipe.calbin"), "directory": str(tmp_path),
            "empty": str(empty), "missing": str(tmp_path / "missing.calbin"),
            "too_large": str(big), "not_a_string": ["a.calbin"],
            "too_long": "/" + "a" * 5000}[case]
    r = _bounded(lambda: client.post("/admin/reload", json={"calbin": path}, headers=AUTH))
    assert_refused_before_the_lifecycle_moved(client, executor, r)


def assert_refused_before_the_lifecycle_moved(client, executor, r) -> None:
    """A 400 ``calbin.*`` naming ``calbin`` and its value; generation 1 serves, undrained."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "calbin" and err["type"] == "invalid_request_error"
    assert err["code"].startswith("calbin.") and err["message"].startswith("calbin="), err
    assert r.json()["status"]["http_status"] == 400
    assert executor.state == "Ready" and executor.gen.id == 1 and not executor.recoveries
    assert executor.life.good_calbins == [executor.gen.calbin_path]
    assert client.get("/ready").status_code == 200
    r = client.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 3})
    assert r.json()["choices"][0]["token_ids"] == oracle_tokens([3, 4, 5], 3)


def _truncated(data: bytes) -> bytes:
    return data[:len(data) // 2]


def _unterminated(data: bytes) -> bytes:
    return data[:data.rindex(b"end\n")]


def _no_decode_model(data: bytes) -> bytes:
    spec = cb.default_spec()
    return cb.dumps(cb.CalbinSpec(spec.seed, [m for m in spec.models if m.name != cb.DECODE]))


def _bad_dtype(data: bytes) -> bytes:
    return data.replace(b"output logits BF16", b"output logits Q4", 1)


@pytest.mark.parametrize("case,code", [
    ("garbage", "calbin.invalid"), ("truncated", "calbin.invalid"),
    ("unterminated", "calbin.invalid"), ("bad_dtype", "calbin.invalid"),
    ("no_decode_model", "calbin.manifest_mismatch")])
def test_reload_refuses_a_file_that_is_no_calbin_with_400_before_any_drain(admin, tmp_path,
                                                                           case, code):
    """A regular, readable file that is not a calbin the manifest describes (garbage bytes, a
    truncated or unterminated calbin, a dtype the runtime does not know, a model the manifest
    needs missing) is refused by ``DeviceExecutor.check_calbin`` with a 400 ``calbin.*``:
    nothing drained, no switch, no rollback. Before the fix the server drained, switched, failed
    the load and rolled back (500 ``recovery.rolled_back``, generation 2)."""
    client, executor, _ = admin
    with open(executor.gen.calbin_path, "rb") as f:
        good = f.read()
    data = {"garbage": lambda _: b"not a calbin " * 16, "truncated": _truncated,
            "unterminated": _unterminated, "bad_dtype": _bad_dtype,
            "no_decode_model": _no_decode_model}[case](good)
    path = tmp_path / f"{case}.calbin"
    path.write_bytes(data)
    r = _bounded(lambda: client.post("/admin/reload", json={"calbin": str(path)},
                                     headers=AUTH))
    assert_refused_before_the_lifecycle_moved(client, executor, r)
    assert r.json()["error"]["code"] == code and str(path) in r.json()["error"]["message"]
    assert executor.check_calbin(str(path)).code == code  # the executor's own answer
    assert executor.check_calbin(executor.gen.calbin_path).ok


@pytest.mark.parametrize("grace", ["1e400", "nan", "-1", "inf", "1e12", "soon", ""])
def test_drain_refuses_a_bad_grace_with_400_and_does_not_start(admin, grace):
    client, executor, service = admin
    r = client.post("/admin/drain", params={"grace": grace}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "grace" and "grace=" in r.json()["error"]["message"]
    assert not service.draining and executor.state == "Ready"
    assert client.get("/ready").status_code == 200


def test_a_good_reload_still_switches(admin, tmp_path):
    client, executor, _ = admin
    other = tmp_path / "other.calbin"
    seed = cb.DEFAULT_SEED ^ 0x55
    sha = cb.write(str(other), cb.default_spec(seed=seed))
    executor.goldens[sha] = tuple(oracle_tokens(list(executor.config.golden_tokens),
                                                executor.config.golden_decode_steps + 1,
                                                seed))  # the operator pins it
    r = client.post("/admin/reload", json={"calbin": str(other)}, headers=AUTH)
    assert r.status_code == 200 and r.json()["generation"] == 2, r.text


# ---- defect 6, end to end: a `calexec serve` process -----------------------------------------------
def test_sigterm_after_a_refused_reload_under_load_exits_0(tmp_path, unpinned):
    """Streaming clients, a calbin with no pinned golden reloaded (refused, rolled back), then
    SIGTERM: every
    stream ends with [DONE] or an SSE error event and the process exits 0. Before the fix the
    requests finishing during the rollback raised AttributeError (streams cut, requests left
    "running" holding their ids) and the drain ended not drained: exit 3."""
    import signal
    import subprocess
    import sys

    from test_server_support import free_port

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "calexec", "serve", "--port", str(port), "--grace", "20",
         "--device-config", "decode_us=10000", "--admin-token-file", str(token_file),
         "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        cwd=tmp_path)
    try:
        wait_serve_ready(proc, url)
        streams: list[list[str]] = []
        stop = threading.Event()

        def stream(i: int) -> None:
            while not stop.is_set():
                lines: list[str] = []
                streams.append(lines)
                with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                                  json={"prompt": [i + 1, 7], "max_tokens": 40,
                                        "stream": True}) as r:
                    if r.status_code != 200:
                        lines.append(f"HTTP {r.status_code} {r.read().decode()}")
                        stop.wait(0.01)
                        continue
                    lines.extend(line for line in r.iter_lines() if line)
        workers = [threading.Thread(target=stream, args=(i,)) for i in range(12)]
        for w in workers:
            w.start()
        wait_for(lambda: sum(1 for lines in streams if len(lines) > 2) >= 12,
                 what="streams going")
        for _ in range(4):
            r = httpx.post(f"{url}/admin/reload", json={"calbin": unpinned}, headers=AUTH,
                           timeout=30)
            assert r.status_code == 500 and r.json()["status"]["code"] == "recovery.rolled_back"
            assert httpx.get(f"{url}/ready", timeout=5).status_code == 200
        stop.set()
        proc.send_signal(signal.SIGTERM)
        for w in workers:
            w.join(30)
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for lines in streams:
        last = lines[-1] if lines else "(no event)"
        if last.startswith("HTTP "):
            assert last.startswith("HTTP 503 {"), last  # refused before it started: JSON
            continue
        assert last == "data: [DONE]" or json.loads(last[len("data: "):])["error"]["code"], \
            lines[-3:]
