"""The hand-offs of a decode burst (issue 28): the loop hands a greedy request's jobs to a
thread of the service's pool (``ServerConfig.decode_bursts``, ``stream_bursts``), which
hands the tokens back. Since stop 69 the job whose token is a non-streamed run's last
(``max_tokens``) is not waited for on that thread (``CompletionService._burst``'s
``hand_last``): the thread that resolves it answers the loop, which takes its result as the
burst's thread takes one (``_take_last``), where the job's thread woke the burst's thread and
that one the loop; a streamed burst's last token is handed with its end, one wake where two
were. A cut of those hand-offs is a claim of equality, so the first test holds the bursts to
the plain path (no bursts, no inline waits); it passes on the code before the cut as after.

A seeded history of non-streamed requests goes, one at a time, to two servers on the same
zero-latency calbin: the defaults (bursts) and the plain path, both without pre-arming (the
policy reads the device's measured speed, which is the host's timing) nor implicit pre-arms,
so both run the same jobs. Requests: greedy of 1-10 tokens (the last job the burst hands
over, the first when there is one token), a stop token id at a drawn position (the last
one among them), seeded sampling (no burst: the plain path on both), two choices (``n``: a burst and a
hand-off each), ``ignore_eos`` (plain or streamed), a device fault armed
on a drawn job of the request (the last one among them: CCU exception, NaN, Wait failure,
submit busy or unavailable; each recovered and the request resumed), a request deadline that
passes mid-generation, a client that leaves mid-generation. For every request whose outcome
is not the host's timing: the same answer (HTTP status, token ids, finish reason, error
code), the same chart path of every job the executor ran for it (kind, final state, status,
each step's event, from and to), and after the history the same ``/metrics`` exposition
(counters, and every histogram's count; a bucket's or sum's value is a time, and the burst
counter exists on one side only). A deadline or a leaving client: the answer's kind and that
both servers get back to idle, every sequence free, nothing armed or in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading

import httpx
import pytest

from calexec.drivers.calrt.runtime import Fault, FaultMode
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.tools.chaos import LiveServer
from calexec.machines.executor import RecoveryPolicy
from calexec.machines.job import JobHandle
from test_server_support import oracle_tokens, started_executor, wait_for

FAULTS = [("CCU_EXCEPTION", 0), ("OUTPUT_NAN", 0), ("WAIT_RC", 0), ("SUBMIT_RC", 17),
          ("SUBMIT_RC", 18)]
PATHS = {"bursts": {"prearm": False},
         "plain": {"prearm": False, "inline_waits": False, "decode_bursts": False,
                   "stream_bursts": False}}
#: metric families that only one path has, or whose value is a time or the host's
SKIP = ("calexec_decode_burst_jobs_total", "process_", "python_")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    made = {}
    with contextlib.ExitStack() as stack:
        for path, settings_ in PATHS.items():
            executor = started_executor(
                tmp_path_factory.mktemp(path), "decode_us=0", auto_prearm=False,
                execution_timeout_s=0.3, timeout_grace_s=0.1, execution_timeout_per_token_s=0.05,
                recovery=RecoveryPolicy(max_recoveries=100_000, drain_grace_s=1.0))
            stack.callback(executor.shutdown, 5.0)
            app = create_app(executor, ServerConfig(**settings_))
            live = stack.enter_context(LiveServer(app))
            made[path] = [live.url, executor, app.state.service, 0]  # 0: the last job id seen
        yield made


def history(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        max_tokens = rng.randint(1, 10)
        spec = {"prompt": [rng.randint(1, 1000) for _ in range(rng.randint(1, 8))],
                "max_tokens": max_tokens, "mode": "plain", "sampled": None, "stop_at": None,
                "fault": None}
        kind = i % 7 if i < 7 else rng.randrange(7)
        if kind == 1:
            spec["stop_at"] = rng.choice([max_tokens - 1, rng.randrange(max_tokens)])
        elif kind == 2:
            spec["sampled"] = rng.randrange(2**16)
        elif kind in (3, 4):  # the last job of the request, or another
            nth = max_tokens if kind == 3 else rng.randint(1, max_tokens)
            spec["fault"] = (rng.randrange(len(FAULTS)), nth)
        elif kind in (5, 6):  # streamed (its decode steps a burst's), a fault on its last job
            spec["mode"] = "stream"
            if kind == 6:
                spec["fault"] = (rng.randrange(len(FAULTS)), max_tokens)
        specs.append(spec)
    more = random.Random(seed + 1)  # (the draws above stay those of the seed's history)
    for i in range(count // 4):  # two choices (a burst and a hand-off each), or ignore_eos
        spec = {**specs[i], "fault": None, "stop_at": None, "sampled": None,
                "mode": more.choice(["plain", "stream"]) if i % 2 else "plain"}
        spec["n" if i % 2 == 0 else "ignore_eos"] = 2 if i % 2 == 0 else True
        specs.append(spec)
    for i in range(count // 4):  # how far these got is the host's timing
        spec = {**specs[i], "mode": "deadline" if i % 2 else "gone", "fault": None,
                "stop_at": None}
        specs.append(spec)
    return specs


def body_of(spec: dict) -> dict:
    body = {"prompt": spec["prompt"], "max_tokens": spec["max_tokens"]}
    if spec["sampled"] is not None:
        body.update(temperature=0.8, seed=spec["sampled"])
    if spec["stop_at"] is not None:
        greedy = oracle_tokens(spec["prompt"], spec["max_tokens"])
        body["stop_token_ids"] = [greedy[min(spec["stop_at"], len(greedy) - 1)]]
    if spec.get("n"):
        body["n"] = spec["n"]
    if spec.get("ignore_eos"):
        body["ignore_eos"] = True
    if spec["mode"] == "deadline":  # passes mid-generation: 10,000 tokens do not fit
        body.update(max_tokens=10_000, timeout=0.02)
    return body


def send(url: str, spec: dict) -> tuple:
    body = body_of(spec)
    if spec["mode"] == "gone":  # leaves mid-generation (how far it got is timing)
        with contextlib.suppress(httpx.TimeoutException), \
                httpx.Client(base_url=url, timeout=0.005) as client:
            client.post("/v1/completions", json={**body, "max_tokens": 10_000})
        return ("gone",)
    if spec["mode"] == "stream":
        return send_streamed(url, body)
    with httpx.Client(base_url=url, timeout=30.0) as client:
        r = client.post("/v1/completions", json=body)
    if r.status_code != 200:
        code = r.json()["error"].get("code")
        if spec["mode"] == "deadline":  # where it was noticed is timing: that it was
            return ("error", r.status_code, str(code).rpartition(".")[2])
        return ("error", r.status_code, code)
    choices = r.json()["choices"]
    if len(choices) > 1:  # (n: every choice, by its index)
        return ("ok", sorted((c["index"], c["token_ids"], c["finish_reason"])
                             for c in choices))
    return ("ok", choices[0]["token_ids"], choices[0]["finish_reason"])


def send_streamed(url: str, body: dict) -> tuple:
    """A streamed request's events, each (text, token ids, finish reason) or its error code,
    and whether ``[DONE]`` came."""
    events: list = []
    with httpx.Client(base_url=url, timeout=30.0) as client, \
            client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return ("error", r.status_code, r.json()["error"].get("code"))
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return ("stream", events, True)
            if line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    events.append(("error", event["error"].get("code")))
                    continue
                choice = event["choices"][0]
                events.append((choice.get("text"), choice.get("token_ids"),
                               choice.get("finish_reason")))
    return ("stream", events, False)


def idle(executor, service) -> bool:
    snap = executor.snapshot()
    return (executor.state == "Ready" and service.active == 0 and snap["inflight"] == 0
            and snap["queued"] == 0 and service.sequences.in_use == 0
            and not executor.dispatch.armed_jobs())


def trails(server: list) -> list:
    """The chart paths of the jobs the executor resolved since the last call, in job order
    (the jobs of one request, and of a recovery's golden run it set off)."""
    executor, last = server[1], server[3]
    found = []
    for job_id in range(last + 1, last + 400):
        trail = executor.job_trail(job_id)
        if trail is not None:
            server[3] = job_id
            found.append((trail["kind"], trail["state"], trail["status"],
                          [(s["event"], s["from"], s["to"]) for s in trail["trail"]]))
    return found


def run_one(server: list, spec: dict) -> tuple:
    url, executor, service = server[:3]
    emu = executor.device.emu
    if spec["fault"] is not None:
        index, nth = spec["fault"]
        name, rc = FAULTS[index]
        assert emu.set_fault(Fault[name], FaultMode.NTH, nth, 7, rc) == 0
    try:
        answer = send(url, spec)
    finally:
        emu.clear_all_faults()
    wait_for(lambda: idle(executor, service), timeout=20.0, what="server idle after a request")
    return answer, trails(server)


def exposition(url: str) -> dict[str, float]:
    """``/metrics``: every counter's and every histogram count's sample (a bucket's or a sum's
    value is a time; families one path has alone, or the process's, left out)."""
    with httpx.Client(base_url=url, timeout=30.0) as client:
        text = client.get("/metrics").text
    kept = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or line.startswith(SKIP):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.split("{")[0]
        if name.endswith(("_bucket", "_sum", "_created")) or (
                "seconds" in name and not name.endswith("_count")):
            continue
        kept[sample] = float(value)
    return kept


def moved(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """The samples that changed since ``before`` (new ones included), by how much."""
    return {k: v - before.get(k, 0.0) for k, v in now.items() if v != before.get(k, 0.0)}


def timed(spec: dict) -> bool:
    """How far the request got, or which of two threads noticed its fault first (a Wait
    failure races the execution timeout's watchdog: ``wait_returned`` or
    ``execution_timeout``, the same status), is the host's timing."""
    return spec["mode"] not in ("plain", "stream") or (spec["fault"] is not None
                                       and FAULTS[spec["fault"][0]][0] == "WAIT_RC")


@pytest.mark.parametrize("seed", [69, 2869])
def test_bursts_hand_off_answers_like_the_plain_path(servers, seed):
    specs = history(seed, 24)
    start = {path: exposition(servers[path][0]) for path in PATHS}
    for spec in specs:
        plain, plain_trails = run_one(servers["plain"], spec)
        fast, fast_trails = run_one(servers["bursts"], spec)
        assert fast == plain, (spec, fast, plain)
        if spec.get("n"):  # (the choices' jobs interleave as the host runs them)
            fast_trails, plain_trails = sorted(map(repr, fast_trails)), sorted(
                map(repr, plain_trails))
        if not timed(spec):
            assert fast_trails == plain_trails, (spec, fast_trails, plain_trails)
        if plain[0] == "ok" and len(plain) == 3 and spec["sampled"] is None \
                and spec["stop_at"] is None and spec["fault"] is None \
                and not spec.get("ignore_eos"):
            assert plain[1] == list(oracle_tokens(spec["prompt"], spec["max_tokens"]))
        if spec["mode"] in ("plain", "stream"):  # (the timed ones come last: the counts so far agree)
            fast_m, plain_m = (moved(exposition(servers[path][0]), start[path])
                               for path in ("bursts", "plain"))
            assert fast_m == plain_m, (spec, set(fast_m.items()) ^ set(plain_m.items()))
            assert any(k.startswith("calexec_requests_total") for k in plain_m), plain_m


def test_the_burst_thread_leaves_the_last_job_to_its_resolving_thread(servers, monkeypatch):
    """The point of the hand-off, counted: an 8-token greedy completion is 8 jobs (a prefill,
    7 decodes), all taken by one burst; its thread waits for the first 7 (``wait_until``) and
    not for the last, whose resolving thread answers the loop (on the code before, the burst's
    thread waited for all 8, then woke the loop itself). The plain path's handler waits for
    none on a burst's thread."""
    waits: dict[tuple[str, bool], int] = {}  # (thread, the job resolved already): calls
    original = JobHandle.wait_until

    def counted(self, deadline):
        key = (threading.current_thread().name.rstrip("0123456789_"), self.done)
        waits[key] = waits.get(key, 0) + 1
        return original(self, deadline)
    monkeypatch.setattr(JobHandle, "wait_until", counted)
    spec = {"prompt": [5, 6, 7], "max_tokens": 8, "mode": "plain", "sampled": None,
            "stop_at": None, "fault": None}
    greedy = list(oracle_tokens([5, 6, 7], 8))
    for _ in range(3):
        assert run_one(servers["bursts"], spec)[0] == ("ok", greedy, "length")
    on_burst = sum(n for (name, _), n in waits.items() if name == "calexec-burst")
    assert on_burst == 3 * 7, waits
    # the loop's look at the 8th job, resolved by then (no wait), and nobody else's
    assert sum(n for (name, done), n in waits.items()
               if name != "calexec-burst" and not done) == 0, waits


class _CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts who wakes it from another thread (``call_soon_threadsafe``),
    by the waking thread's name (its number left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.wakes: dict[str, int] = {}

    def call_soon_threadsafe(self, *args, **kwargs):
        name = threading.current_thread().name.rstrip("0123456789_")
        self.wakes[name] = self.wakes.get(name, 0) + 1
        return super().call_soon_threadsafe(*args, **kwargs)


async def _asgi_completion(app, body: dict) -> tuple[int, bytes]:
    """One POST /v1/completions to ``app`` in this process (no socket): (status, body)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
    sent, done, status, chunks = [False], asyncio.Event(), [], []

    async def receive():
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                done.set()
    await app(scope, receive, send)
    done.set()
    return status[0], b"".join(chunks)


def test_the_loop_is_woken_once_a_burst_and_once_a_streamed_token(tmp_path):
    """Who wakes the event loop, counted per request (the app in this process on a loop that
    counts ``call_soon_threadsafe`` by thread, zero latency, no pre-arming): an 8-token greedy
    completion's burst wakes it once, as before (then from the burst's thread once it had
    waited for the last job, now from the thread that resolved that job); a
    streamed one's burst (its 7 decode steps; the prefill takes the plain path) at most once
    per token but its last, whose hand-off is the burst's end (before: once more for the
    last token, then for the end: about 8 a stream, 153-159 for these 20 in three runs).
    That the burst's thread no longer waits for the last job is counted exactly above."""
    executor = started_executor(tmp_path, "decode_us=0", auto_prearm=False)
    requests = 20
    greedy = list(oracle_tokens([5, 6, 7], 8))
    try:
        app = create_app(executor, ServerConfig(prearm=False))
        loop = _CountingLoop()

        async def main() -> tuple[dict[str, int], dict[str, int]]:
            async with app.router.lifespan_context(app):
                body = {"prompt": [5, 6, 7], "max_tokens": 8}
                await _asgi_completion(app, body)  # (threads started, first costs paid)
                loop.wakes.clear()
                for _ in range(requests):
                    status, answer = await _asgi_completion(app, body)
                    assert status == 200
                    assert json.loads(answer)["choices"][0]["token_ids"] == greedy
                plain = dict(loop.wakes)
                loop.wakes.clear()
                for _ in range(requests):
                    status, answer = await _asgi_completion(app, {**body, "stream": True})
                    assert status == 200 and answer.endswith(b"data: [DONE]\n\n")
                return plain, dict(loop.wakes)
        try:
            plain, streamed = loop.run_until_complete(main())
        finally:
            loop.close()
    finally:
        executor.shutdown(5.0)
    # once a request: from the thread that resolved the last job (or, when that job was
    # resolved before the burst's thread registered for it, that thread: no wait either)
    assert sum(plain.values()) == requests, plain
    assert set(plain) <= {"calexec-completion", "calexec-burst"}, plain
    # per stream: the prefill's wait (the resolving thread) and its enqueue's worker thread,
    # then at most 6 hand-offs of a decode token and the burst's end
    assert streamed.get("calexec-burst", 0) <= 7 * requests, streamed


def _answer_on_device_at_deadline(tmp_path, path: str) -> tuple:
    """A 1-token greedy completion (its prefill the last job, the one a burst hands over)
    whose job is on the device when the request's 1 s timeout passes (the prefill takes
    3 s), on a fresh server of ``path`` with 5 s of slack (the loop's own cut: 0.5 s after
    the deadline): (HTTP status, error code, message)."""
    tmp_path.mkdir()
    executor = started_executor(tmp_path, "decode_us=0", auto_prearm=False)
    try:
        app = create_app(executor, ServerConfig(**PATHS[path], deadline_slack_s=5.0))
        service = app.state.service
        with LiveServer(app) as live:
            assert executor.device.emu.set_latency(0, 3_000_000, 0, 0) == 0
            with httpx.Client(base_url=live.url, timeout=30.0) as client:
                r = client.post("/v1/completions",
                                json={"prompt": [5], "max_tokens": 1, "timeout": 1.0})
            executor.device.emu.set_latency(0, 0, 0, 0)
            wait_for(lambda: idle(executor, service), timeout=20.0,
                     what="server idle after the deadline")
    finally:
        executor.shutdown(5.0)
    error = r.json()["error"]
    return r.status_code, error.get("code"), error["message"]


def test_a_handed_last_job_still_on_the_device_at_the_deadline_answers_then(tmp_path):
    """The job a non-streamed burst hands over (its token the run's last) and that the
    device still runs when the request's deadline passes: the plain path's wait (and the
    burst's thread, before stop 69) answers at the deadline, ``wait_until deadline
    passed``. The hand-off waited for the job's resolution instead: the loop's own cut a
    tenth of the slack later (504 "the server stopped waiting"), or the job's tokens when it
    ended within that tenth (200 after the timeout, where the plain path answers 504)."""
    plain = _answer_on_device_at_deadline(tmp_path / "plain", "plain")
    fast = _answer_on_device_at_deadline(tmp_path / "bursts", "bursts")
    assert plain[0] == 504 and "wait_until deadline passed" in plain[2], plain
    assert fast == plain


def test_a_client_leaving_during_the_handed_last_job_keeps_its_sequence_until_it_ended(
        tmp_path):
    """The handed last job runs outside the burst's enqueue fence (``enqueue_idle`` set):
    a client that leaves while it is on the device ends the request at once, and its
    sequence is given back only once that job ended (``finish`` then ``release_when_done``
    wait for ``run.handle``, the handed job), never under it."""
    executor = started_executor(tmp_path, "decode_us=0", auto_prearm=False)
    try:
        app = create_app(executor, ServerConfig(**PATHS["bursts"]))
        service = app.state.service
        with LiveServer(app) as live:
            assert executor.device.emu.set_latency(0, 3_000_000, 0, 0) == 0
            with contextlib.suppress(httpx.TimeoutException), \
                    httpx.Client(base_url=live.url, timeout=0.3) as client:
                client.post("/v1/completions", json={"prompt": [5], "max_tokens": 1})
            wait_for(lambda: service.active == 0, timeout=20.0, what="the request ended")
            on_device = executor.snapshot()["inflight"]
            if on_device:  # (the job still on the device: 3 s)
                assert service.sequences.in_use == 1, service.sequences.counts()
            executor.device.emu.set_latency(0, 0, 0, 0)
            wait_for(lambda: idle(executor, service), timeout=20.0,
                     what="server idle after the job ended")
        assert service.sequences.counts()["withheld"] == 0, service.sequences.counts()
    finally:
        executor.shutdown(5.0)
