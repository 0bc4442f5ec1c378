"""Stop 48 (load48): seeded fault schedules under load, through the HTTP server, for the
combinations tests/test_chaos.py, tests/test_server_faultload.py, tests/test_soak.py and
``calexec bench faults`` do not drive: faults armed while a model switch runs under
streaming load; Phase B (two jobs in flight) with clients cancelling as faults fire; slow
readers whose streams are resumed; deadlines that expire during a recovery; ``n`` > 1 and
prompt lists, ``logprobs`` and ``echo`` requests during faults; an admin drain while a fault
is armed; all at the 2 ms decode profile (pre-armed decode streams, greedy ahead).

After each schedule: every answer is the oracle's tokens (greedy: the synthetic model is
deterministic) or a documented error (a JSON body with a code, or an SSE error event; 504 only
for a request whose own deadline passed; a 5xx device error only for the faults the server does
not resume from); no answer later than its deadline + slack (+ the harness's allowance: the
clients share the process); once idle, no request running or waiting, every sequence id free,
no slot leased or in flight, no job queued, in flight or pre-armed, the KV as at the start;
every request counted once in ``calexec_request_success_total`` + ``_failures_total``; then a
request gets 200.

Loopback uvicorn on 127.0.0.1 (ephemeral port), the bundled emulator; every wait bounded.
Seeds: ``CALEXEC_LOAD48_SEEDS`` per scenario (default 1 in CI; e.g. 20 locally),
``CALEXEC_LOAD48_SEED0`` the first one, ``CALEXEC_LOAD48_STEPS`` fault steps per schedule.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

import needs

needs.module("httpx", "server")
import httpx  # noqa: E402

from calexec.contracts.manifest import default_manifest_path, load_manifest  # noqa: E402
from calexec.drivers.calrt.runtime import CalRT  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.drivers.synthetic import calbin  # noqa: E402
from calexec.drivers.tools.chaos import FAULTS, arm_fault, oracle_tokens  # noqa: E402
from calexec.machines.executor import DeviceExecutor, ExecutorConfig  # noqa: E402
from calexec.machines.faults import RecoveryPolicy  # noqa: E402
from test_server_support import (  # noqa: E402
    ServeLikeServer,
    metric_value,
    read_until_closed,
    stalled_client,
)

SEEDS = int(os.environ.get("CALEXEC_LOAD48_SEEDS", "1"))
SEED0 = int(os.environ.get("CALEXEC_LOAD48_SEED0", "4800"))
STEPS = int(os.environ.get("CALEXEC_LOAD48_STEPS", "6"))
TOKEN = "load48-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SLACK_S = 0.5  # ServerConfig.deadline_slack_s (the default)
ALLOWANCE_S = 1.5  # the clients share the server's process and the host's 2 cores
MAX_SEQUENCES = 6
#: the faults whose job's request is not resumed (docs/server.md "Resumable generations"):
#: SetCsr / Slice failures are artifact errors
NOT_RESUMED_CODES = {"calrt.csr_failed", "calrt.slice_failed", "calrt.slice_fail"}
FAULT_ACTIONS = tuple(f[0] for f in FAULTS)


@dataclass
class Record:
    kind: str
    body: dict[str, Any]
    start: float = 0.0
    end: float = 0.0
    status: int | None = None
    error: dict[str, Any] | None = None  # the JSON error (body or SSE event)
    transport: str | None = None
    choices: dict[int, list[int]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    logprobs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    usage: dict[str, int] | None = None
    prompt_ids: list[int] | None = None  # a chat's prompt, as the server rendered it
    ended: str | None = None  # "done", "error", "left", "cut"


def executor_for(tmp, phase_b: bool, decode_us: int) -> DeviceExecutor:
    path = str(tmp / "synthetic.calbin")
    calbin.write(path, calbin.default_spec())
    executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                              ExecutorConfig(
                                  calbin_path=path, inflight_capacity=2 if phase_b else 1,
                                  device_config=f"decode_us={decode_us};prefill_per_token_us=50",
                                  execution_timeout_s=0.5, timeout_grace_s=0.1,
                                  golden_timeout_s=5.0,
                                  recovery=RecoveryPolicy(max_recoveries=1_000_000,
                                                          drain_grace_s=0.3)))
    status = executor.start()
    if not status.ok:
        raise RuntimeError(f"executor did not start: {status}")
    return executor


def _body(kind: str, rng: random.Random) -> dict[str, Any]:
    prompt = [rng.randrange(1, 150000) for _ in range(rng.randint(1, 8))]
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": rng.randint(2, 8),
                            "timeout": rng.uniform(4.0, 8.0)}
    if kind in ("stream", "slow", "vanish"):
        body["stream"] = True
    elif kind == "short":
        body["timeout"] = rng.uniform(0.05, 0.6)
        body["stream"] = rng.random() < 0.5
    elif kind == "n2":
        body["n"] = 2
        body["stream"] = rng.random() < 0.5
    elif kind == "batch":
        body["prompt"] = [prompt, [rng.randrange(1, 150000) for _ in range(rng.randint(1, 6))]]
        body["stream"] = rng.random() < 0.5
    elif kind == "logprobs":
        body["logprobs"] = rng.randint(0, 3)
        body["stream"] = rng.random() < 0.5
    elif kind == "stalled":  # a stream the client stops reading: its send is cut
        body.update(stream=True, max_tokens=rng.randint(300, 600),
                    timeout=rng.uniform(0.8, 2.0))
    elif kind == "chat":
        body = {"messages": [{"role": "user", "content": f"hi {rng.randrange(1 << 20)}"}],
                "max_tokens": body["max_tokens"], "timeout": body["timeout"],
                "return_token_ids": True, "n": rng.choice([1, 2]),
                "stream": rng.random() < 0.5}
    elif kind == "sampled":
        body.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1 << 31))
        body["stream"] = rng.random() < 0.5
    elif kind == "echo":
        body["prompt"] = prompt[:3]
        body.update(echo=True, logprobs=1, max_tokens=rng.randint(1, 3))
        body["stream"] = rng.random() < 0.5
    if body.get("stream") and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def _prompts(body: dict[str, Any], rec: Record | None = None) -> list[list[int]]:
    if "messages" in body:
        return [rec.prompt_ids if rec is not None and rec.prompt_ids is not None else []]
    prompt = body["prompt"]
    return prompt if prompt and isinstance(prompt[0], list) else [prompt]


def _stalled(port: int, rec: Record) -> None:
    """Send ``rec.body`` from a client that never reads, until the request's deadline +
    slack + the allowance; then read what came: the server must have cut the connection."""
    sock = stalled_client(port, rec.body)
    try:
        time.sleep(rec.body["timeout"] + SLACK_S + ALLOWANCE_S)
        data, how = read_until_closed(sock)
    finally:
        sock.close()
    rec.ended = "left"
    if how == "open":
        rec.transport = f"the stalled stream was not cut ({len(data)} bytes)"
    head, _, rest = data.partition(b"\r\n\r\n")
    rec.status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else None
    for line in rest.decode("utf-8", "replace").splitlines():
        if line.startswith("data: {") and line.endswith("}"):
            event = json.loads(line[6:])
            for choice in event.get("choices", ()):
                rec.choices.setdefault(choice["index"], []).extend(choice["token_ids"])


def _request(http: httpx.Client, kind: str, body: dict[str, Any], rng: random.Random,
             stop: threading.Event, port: int = 0) -> Record:
    rec = Record(kind, body)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    rec.start = time.monotonic()
    try:
        if kind == "stalled":
            _stalled(port, rec)
        elif not body.get("stream"):
            timeout = rng.uniform(0.01, 0.3) if kind == "cancel" else 30
            r = http.post(path, json=body, timeout=timeout)
            rec.status = r.status_code
            data = r.json()
            if r.status_code != 200:
                rec.error = data.get("error") if isinstance(data, dict) else None
                rec.ended = "error"
            else:
                for choice in data["choices"]:
                    i = choice["index"]
                    rec.choices[i] = list(choice["token_ids"])
                    rec.finish[i] = choice["finish_reason"]
                    rec.prompt_ids = choice.get("prompt_token_ids", rec.prompt_ids)
                    if choice.get("logprobs"):
                        rec.logprobs[i] = [choice["logprobs"]]
                rec.usage = data.get("usage")
                rec.prompt_ids = data.get("prompt_token_ids")
                rec.ended = "done"
        else:
            keep = rng.randint(1, 3) if kind == "vanish" else None
            with http.stream("POST", path, json=body, timeout=30) as r:
                rec.status = r.status_code
                if r.status_code != 200:
                    data = json.loads(r.read())
                    rec.error = data.get("error") if isinstance(data, dict) else None
                    rec.ended = "error"
                else:
                    events = 0
                    for line in r.iter_lines():
                        if not line:
                            continue
                        events += 1
                        payload = line[len("data: "):]
                        if payload == "[DONE]":
                            rec.ended = "done"
                            continue
                        event = json.loads(payload)
                        if "error" in event:
                            rec.error, rec.ended = event["error"], "error"
                            continue
                        if event.get("usage"):
                            rec.usage = event["usage"]
                        rec.prompt_ids = event.get("prompt_token_ids", rec.prompt_ids)
                        for choice in event["choices"]:
                            i = choice["index"]
                            rec.prompt_ids = choice.get("prompt_token_ids", rec.prompt_ids)
                            rec.choices.setdefault(i, []).extend(choice.get("token_ids", []))
                            if choice.get("finish_reason"):
                                rec.finish[i] = choice["finish_reason"]
                            if choice.get("logprobs"):
                                rec.logprobs.setdefault(i, []).append(choice["logprobs"])
                        if kind == "slow":
                            stop.wait(rng.uniform(0.01, 0.04))
                        if keep is not None and events >= keep:
                            rec.ended = "left"
                            break
                    rec.ended = rec.ended or "cut"
    except httpx.TimeoutException:
        rec.ended = "left"
    except httpx.HTTPError as err:
        rec.transport = repr(err)
    rec.end = time.monotonic()
    return rec


def _client(url: str, seed: int, kinds: tuple[str, ...], stop: threading.Event,
            out: list[Record]) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            kind = rng.choice(kinds)
            rec = _request(http, kind, _body(kind, rng), rng, stop,
                           int(url.rsplit(":", 1)[1]))
            out.append(rec)
            if rec.status in (429, 503):
                stop.wait(rng.uniform(0.02, 0.1))


def check_record(rec: Record, problems: list[str]) -> None:
    """What is wrong with one answer (module docstring), appended to ``problems``."""
    body = rec.body
    where = f"{rec.kind} {json.dumps(body)}"
    if rec.transport is not None:
        problems.append(f"{where}: transport error {rec.transport}")
        return
    if rec.ended in (None, "cut"):
        problems.append(f"{where}: the response ended without [DONE] or an error ({rec.ended})")
    if rec.kind not in ("vanish", "cancel", "stalled") and \
            rec.end - rec.start > body["timeout"] + SLACK_S + ALLOWANCE_S:
        problems.append(f"{where}: answered {rec.end - rec.start:.3f}s after it was sent "
                        f"(timeout {body['timeout']:.3f}s)")
    if rec.status not in (200, 429, 500, 503, 504) and rec.ended != "left":
        problems.append(f"{where}: undocumented HTTP {rec.status}")
    if rec.ended == "error":
        code = (rec.error or {}).get("code")
        if not code:
            problems.append(f"{where}: an error without a code: {rec.error}")
    if "messages" in body and rec.prompt_ids is None and rec.choices:
        if rec.ended == "done":
            problems.append(f"{where}: no prompt_token_ids (return_token_ids)")
        return
    n = body.get("n", 1)
    prompts = _prompts(body, rec)
    echo = bool(body.get("echo"))
    if rec.ended == "done" and (not body.get("stream") or body.get("stream_options")):
        generated = sum(len(t) for t in rec.choices.values())
        if rec.usage is None or rec.usage["completion_tokens"] != generated or \
                rec.usage["prompt_tokens"] != sum(len(p) for p in prompts):
            problems.append(f"{where}: usage {rec.usage} for {generated} tokens")
    for index, tokens in rec.choices.items():
        prompt = prompts[index // n]
        if "seed" in body:
            continue  # sampled: held against its fault-free replay (run_schedule)
        # (a client that left: as far as it read; the oracle's prefixes agree)
        expected = list(oracle_tokens(tuple(prompt), max(1, len(tokens)) if rec.ended == "left"
                                      else body["max_tokens"]))
        if tokens != expected[:len(tokens)]:
            problems.append(f"{where}: choice {index} {tokens} != oracle {expected}")
            continue
        finish = rec.finish.get(index)
        if rec.ended == "done" and finish == "length" and len(tokens) != body["max_tokens"]:
            problems.append(f"{where}: choice {index} {len(tokens)} tokens, finish length")
        if rec.ended == "done" and finish is None:
            problems.append(f"{where}: choice {index} has no finish_reason")
        if body.get("logprobs") is not None and rec.ended == "done":
            parts = rec.logprobs.get(index, [])
            got = [t for part in parts for t in part["token_logprobs"]]
            want = len(tokens) + (len(prompt) if echo else 0)
            if len(got) != want:
                problems.append(f"{where}: choice {index}: {len(got)} token_logprobs for "
                                f"{want} tokens")
            tops = [t for part in parts for t in part["top_logprobs"]]
            for top, lp in list(zip(tops, got))[len(prompt) if echo else 0:]:
                # greedy: the chosen token is the most likely one
                if top is not None and top and lp is not None and lp < max(top.values()) - 1e-6:
                    problems.append(f"{where}: choice {index}: chosen logprob {lp} below "
                                    f"the top {top}")
    if rec.ended == "done":
        want = {i * n + j for i in range(len(prompts)) for j in range(n)}
        if set(rec.choices) != want:
            problems.append(f"{where}: choices {sorted(rec.choices)} != {sorted(want)}")


@dataclass
class Schedule:
    phase_b: bool = False
    decode_us: int = 2000
    kinds: tuple[str, ...] = ("plain", "stream", "slow", "vanish", "cancel", "short")
    actions: tuple[str, ...] = FAULT_ACTIONS
    switch: bool = False  # arm a fault, then switch the model under it
    drain: bool = False  # end with an admin drain while a fault is armed
    clients: int = 5
    small_buffers: bool = False  # the server's sends stall after ~12 KB (a "stalled" client)


def run_schedule(tmp, seed: int, plan: Schedule, steps: int = STEPS) -> dict[str, Any]:
    """One seeded schedule; returns ``problems`` and the figures (module docstring)."""
    executor = executor_for(tmp, plan.phase_b, plan.decode_us)
    main_calbin = executor.gen.calbin_path if executor.gen is not None else ""
    other = str(tmp / "other.calbin")
    shutil.copyfile(main_calbin, other)  # the same model at another path: the oracle holds
    app = create_app(executor, ServerConfig(admin_token=TOKEN, max_sequences=MAX_SEQUENCES,
                                            max_waiting=64))
    service = app.state.service
    emu = executor.device.emu
    rng = random.Random(seed)
    records: list[Record] = []
    problems: list[str] = []
    done: list[str] = []
    stop = threading.Event()
    metrics = ""
    after: httpx.Response | None = None
    try:
        with ServeLikeServer(app, plan.small_buffers) as server, httpx.Client(base_url=server.url,
                                                          timeout=30) as admin:
            threads = [threading.Thread(target=_client, args=(
                server.url, seed * 100 + i, plan.kinds, stop, records), daemon=True,
                name=f"load48-client-{i}") for i in range(plan.clients)]
            for thread in threads:
                thread.start()
            try:
                for step in range(steps):
                    action = rng.choice(plan.actions)
                    _, point, rc = next(f for f in FAULTS if f[0] == action)
                    arm_fault(emu, point, rng, rc)
                    if plan.switch and rng.random() < 0.6:
                        stop.wait(rng.uniform(0.0, 0.1))
                        r = admin.post("/admin/reload", json={
                            "calbin": rng.choice([main_calbin, other])}, headers=AUTH)
                        done.append(f"{action}+switch:{r.status_code}")
                        if r.status_code not in (200, 500, 503) or (
                                r.status_code != 200 and "error" not in r.json()):
                            problems.append(f"switch under {action}: HTTP {r.status_code} "
                                            f"{r.text[:300]}")
                    else:
                        done.append(action)
                    if plan.drain and step == steps - 1:
                        break  # the drain meets the armed fault
                    stop.wait(rng.uniform(0.15, 0.4))
                    end = time.monotonic() + 20
                    while admin.get("/ready").status_code != 200:
                        if time.monotonic() > end:
                            problems.append(f"{action}: /ready not 200 within 20 s "
                                            f"({executor.state}, {executor.health()})")
                            break
                        stop.wait(0.02)
                    emu.clear_all_faults()
                    if not service.sequences.consistent():
                        problems.append(f"{action}: ids {service.sequences.counts()}")
                if plan.drain:
                    r = admin.post("/admin/drain", params={"grace": 5}, headers=AUTH)
                    if r.status_code != 202:
                        problems.append(f"drain: HTTP {r.status_code} {r.text[:300]}")
                    end = time.monotonic() + 30
                    while service.drain_status is None and time.monotonic() < end:
                        stop.wait(0.02)
            finally:
                stop.set()
                for thread in threads:
                    thread.join(40)
            if any(thread.is_alive() for thread in threads):
                problems.append("a client never returned")
            emu.clear_all_faults()
            end = time.monotonic() + 30
            while time.monotonic() < end and not _idle(executor, service, plan.drain):
                time.sleep(0.02)
            if not _idle(executor, service, plan.drain):
                problems.append(f"not idle: {_state(executor, service)}")
            metrics = admin.get("/metrics").text
            if not plan.drain:
                after = admin.post("/v1/completions", json={"prompt": [1, 2, 3],
                                                            "max_tokens": 3})
                _replay_sampled(admin, records, problems)
    finally:
        stop.set()
        emu.clear_all_faults()
        if not executor.lifecycle.final:
            executor.shutdown(5.0)
    for rec in records:
        check_record(rec, problems)
    _check_counts(records, metrics, plan, problems)
    if plan.drain:
        if service.drain_status is None or not service.drain_status.ok \
                or executor.state != "Stopped":
            problems.append(f"drain ended {service.drain_status} in {executor.state}")
    elif after is None or after.status_code != 200:
        problems.append(f"after the load: {None if after is None else after.text}")
    errors = Counter((r.kind, r.status, (r.error or {}).get("code")) for r in records
                     if r.ended == "error")
    return {"problems": problems, "records": records, "steps": done, "errors": errors,
            "recoveries": len(executor.recoveries), "metrics": metrics}


def _replay_sampled(http: httpx.Client, records: list[Record], problems: list[str]) -> None:
    """A seeded sampled request's tokens under faults are those of the same body answered
    fault-free (afterwards, not streamed)."""
    for rec in records:
        if "seed" not in rec.body or not rec.choices:
            continue
        body = {k: v for k, v in rec.body.items() if k not in ("stream", "stream_options")}
        body["timeout"] = 30
        r = http.post("/v1/completions", json=body)
        if r.status_code != 200:
            problems.append(f"replay of {json.dumps(body)}: HTTP {r.status_code} {r.text}")
            continue
        for choice in r.json()["choices"]:
            got = rec.choices.get(choice["index"])
            if got is not None and got != choice["token_ids"][:len(got)]:
                problems.append(f"sampled {json.dumps(rec.body)}: choice {choice['index']} "
                                f"{got} != fault-free {choice['token_ids']}")


def _idle(executor, service, stopped: bool) -> bool:
    snap = executor.snapshot()
    counts = service.sequences.counts()
    base = (service.active == 0 and service.releases_pending == 0 and counts["in_use"] == 0
            and service.admission.waiting == 0)
    if stopped:
        return base and executor.lifecycle.final
    return (base and counts["withheld"] == 0 and executor.state == "Ready"
            and not executor.health() and snap["inflight"] == 0 and snap["queued"] == 0
            and snap["completing"] == 0 and snap["auto_armed"] == 0)


def _state(executor, service) -> dict[str, Any]:
    return {"active": service.active, "releases_pending": service.releases_pending,
            "waiting": service.admission.waiting, "sequences": service.sequences.counts(),
            "lifecycle": executor.state, "health": executor.health(),
            "snapshot": {k: v for k, v in executor.snapshot().items()
                         if k in ("inflight", "queued", "completing", "auto_armed", "slots")}}


def _check_counts(records: list[Record], metrics: str, plan: Schedule,
                  problems: list[str]) -> None:
    """The counters add up: each choice of an admitted request, and each request refused
    before admission, is counted once in ``_success_total`` + ``_failures_total``."""
    from prometheus_client.parser import text_string_to_metric_families

    def total(name: str, **labels: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                   if s.name == name and labels.items() <= s.labels.items())

    if not metrics:
        problems.append("no /metrics read")
        return
    succeeded = sum(len(r.choices) for r in records if r.ended == "done" and r.status == 200)
    success = total("calexec_request_success_total")
    failures = total("calexec_request_failures_total")
    # the least: one per request; the most: one per choice
    least = len(records)
    most = sum(len(_prompts(r.body)) * r.body.get("n", 1) for r in records)
    if not least <= success + failures <= most:
        problems.append(f"success {success} + failures {failures} outside [{least}, {most}] "
                        f"requests/choices sent")
    # a client that left may have had its answer counted; so may the choices of a request
    # of several that another choice's failure ended
    unseen = [r for r in records if r.ended == "left" or r.ended == "error" and (
        len(_prompts(r.body)) * r.body.get("n", 1) > 1)]
    most_unseen = sum(len(_prompts(r.body)) * r.body.get("n", 1) for r in unseen)
    gone = total("calexec_request_failures_total", code="request.cancelled") + total(
        "calexec_request_failures_total", code="request.client_stalled")
    most_left = sum(len(_prompts(r.body)) * r.body.get("n", 1) for r in records
                    if r.ended == "left")
    if gone > most_left:  # counted as clients gone: at most the clients that left
        problems.append(f"{gone} requests counted cancelled or stalled, {most_left} left")
    if not succeeded <= success <= succeeded + most_unseen:
        problems.append(f"success {success}: clients saw {succeeded} choices (+{most_unseen} "
                        f"unseen)")
    if not plan.drain:
        for name in ("calexec_num_requests_running", "calexec_num_requests_waiting",
                     "calexec_kv_sequences_in_use", "calexec_kv_sequences_withheld",
                     "calexec_jobs_inflight", "calexec_queue_depth", "calexec_pending_tokens",
                     "calexec_responses_send_waiting", "calexec_kv_cache_usage_perc"):
            if metric_value(metrics, name) != 0:
                problems.append(f"{name} {metric_value(metrics, name)} when idle")
        for state in ("Leased", "InFlight"):
            value = metric_value(metrics, "calexec_buffer_slots", {"state": state})
            if value != 0:
                problems.append(f"buffer slots {state} {value} when idle")
        if metric_value(metrics, "calexec_kv_sequences_free") != MAX_SEQUENCES:
            problems.append(f"free ids {metric_value(metrics, 'calexec_kv_sequences_free')}")


def _unexpected_errors(result: dict[str, Any], allowed: set[str]) -> list[str]:
    """Errors clients saw that the schedule does not explain: a code outside ``allowed``
    (a deadline's only for a request whose deadline passed; a drain's 503 only before the
    response started), beyond the requests whose resume budget ran out
    (``calexec_resume_budget_exhausted_total``: they get the failure they would have got
    without resuming, docs/server.md "Resumable generations")."""
    out = []
    for rec in result["records"]:
        if rec.ended != "error":
            continue
        code = (rec.error or {}).get("code")
        message = (rec.error or {}).get("message", "")
        if "draining" in allowed and rec.status == 503 and code == "lifecycle.unavailable" \
                and ("draining" in message or message.startswith("server drained: ")):
            # refused by the drain: not admitted ("server drained: ...": its body was still
            # arriving when the drain stopped waiting, wire.body_or_refusal)
            continue
        if rec.end - rec.start >= rec.body["timeout"] - 0.05:
            # its deadline passed: a deadline code, or the failure a resume the deadline
            # cut short would have hidden (docs/server.md "Resumable generations")
            continue
        if code not in allowed:
            out.append(f"{rec.kind} HTTP {rec.status} {rec.error} {json.dumps(rec.body)}")
    exhausted = int(metric_value(result["metrics"], "calexec_resume_budget_exhausted_total")
                    or 0) if result["metrics"] else 0
    return out if len(out) > exhausted else []


SCENARIOS = {
    # faults armed as a model switch runs, under streaming and slow readers
    "switch": (Schedule(switch=True, kinds=("stream", "slow", "vanish", "plain", "short",
                                            "sampled", "n2")),
               NOT_RESUMED_CODES | {"recovery.rolled_back"}),
    # Phase B, clients leaving at any moment while faults fire
    "phase_b": (Schedule(phase_b=True, kinds=("plain", "stream", "cancel", "vanish", "slow",
                                              "n2", "logprobs", "sampled")), NOT_RESUMED_CODES),
    # clients that stop reading (their sends stall, then are cut at their deadline) while
    # faults make their streams resume, beside slow readers
    "stalled": (Schedule(small_buffers=True, kinds=("stalled", "slow", "stream", "plain",
                                                    "stalled")), NOT_RESUMED_CODES),
    # all of it at once: Phase B, switches under faults, every kind of client
    "everything": (Schedule(phase_b=True, switch=True, clients=7, kinds=(
        "plain", "stream", "slow", "vanish", "cancel", "short", "n2", "batch", "logprobs",
        "echo", "sampled", "chat")), NOT_RESUMED_CODES | {"recovery.rolled_back"}),
    # n > 1, prompt lists, logprobs and echo while faults fire
    "choices": (Schedule(kinds=("n2", "batch", "logprobs", "echo", "stream", "sampled",
                                "chat")),
                NOT_RESUMED_CODES | {"request.choice_cancelled"}),
    # deadlines that expire during a recovery (hung jobs: the longest recoveries)
    "deadlines": (Schedule(kinds=("short", "short", "slow", "plain"),
                           actions=("hang", "hang_stale", "ccu_exception", "wait_rc")),
                  NOT_RESUMED_CODES),
    # an admin drain while a fault is armed
    "drain": (Schedule(drain=True, kinds=("stream", "slow", "plain", "n2", "short")),
              NOT_RESUMED_CODES | {"draining"}),
}


#: (scenario, seed, steps) of schedules that found a defect, run on every CI run. A schedule
#: is seeded, its timing is the host's: ("drain", 5002, 10) met the defect of
#: test_a_drain_lets_an_admitted_request_of_several_choices_finish on some runs only (that
#: test meets it on every run)
REGRESSIONS = [("drain", 5002, 10)]


def _schedule(tmp_path, scenario: str, seed: int, steps: int) -> None:
    plan, allowed = SCENARIOS[scenario]
    result = run_schedule(tmp_path, seed, plan, steps)
    problems = result["problems"] + _unexpected_errors(result, allowed)
    summary = {"steps": result["steps"], "requests": len(result["records"]),
               "threads": threading.active_count(),
               "errors": {str(k): v for k, v in result["errors"].items()},
               "recoveries": result["recoveries"]}
    print(f"load48 {scenario} seed {seed}:", json.dumps(summary))
    assert result["records"], summary
    assert not problems, (summary, len(problems), problems[:8])


@pytest.mark.parametrize("seed", range(SEED0, SEED0 + SEEDS))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_seeded_fault_schedule_under_load(tmp_path, scenario, seed):
    _schedule(tmp_path, scenario, seed, STEPS)


@pytest.mark.parametrize("scenario,seed,steps", REGRESSIONS)
def test_a_schedule_that_found_a_defect(tmp_path, scenario, seed, steps):
    _schedule(tmp_path, scenario, seed, steps)


# ---- regressions: each failed on the code before its fix ------------------------------------
def _drain_meets_a_request_of_several_choices(tmp_path, stream: bool) -> tuple[Any, Any, Any]:
    """A request of 4 choices on a server of 2 sequence ids (its choices run one at a time,
    20 ms decode steps) and a drain (grace 20 s) started once its first choice runs: the
    response, the service and the executor after the drain."""
    from test_server_support import started_executor, wait_for

    executor = started_executor(tmp_path, "decode_us=20000")
    app = create_app(executor, ServerConfig(admin_token=TOKEN, max_sequences=2))
    service = app.state.service
    body = {"prompt": [5, 6, 7], "n": 4, "max_tokens": 6, "stream": stream, "timeout": 30}
    out: dict[str, Any] = {}
    try:
        with ServeLikeServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=30) as http:
            def post() -> None:
                if stream:
                    with http.stream("POST", "/v1/completions", json=body) as r:
                        out["status"] = r.status_code
                        out["lines"] = [line for line in r.iter_lines() if line]
                else:
                    r = http.post("/v1/completions", json=body)
                    out["status"], out["json"] = r.status_code, r.json()
            thread = threading.Thread(target=post, daemon=True)
            thread.start()
            wait_for(lambda: service.active >= 1 and executor.snapshot()["succeeded"] > 0, 20,
                     "the first choice running")
            r = http.post("/admin/drain", params={"grace": 20}, headers=AUTH)
            assert r.status_code == 202, r.text
            thread.join(40)
            assert not thread.is_alive()
            wait_for(lambda: service.drain_status is not None, 30, "the drain's end")
    finally:
        if not executor.lifecycle.final:
            executor.shutdown(5.0)
    return out, service, executor


@pytest.mark.parametrize("stream", [True, False])
def test_a_drain_lets_an_admitted_request_of_several_choices_finish(tmp_path, stream):
    """A drain lets admitted requests finish within its grace (docs/server.md "Drain"): the
    later choices of a request of several (``n`` > 1, a prompt list) are part of it. They were
    refused as new work ("server is draining", 503 ``lifecycle.unavailable``) once they came
    to run, and the whole request failed: an error event after the first choice's chunks, or a
    503 instead of the answer (found by the "drain" schedule, seed 5002 at 10 steps)."""
    out, service, executor = _drain_meets_a_request_of_several_choices(tmp_path, stream)
    expected = oracle_tokens((5, 6, 7), 6)
    assert out["status"] == 200, out
    if stream:
        assert out["lines"][-1] == "data: [DONE]", out["lines"][-3:]
        tokens: dict[int, list[int]] = {}
        for line in out["lines"][:-1]:
            for choice in json.loads(line[6:])["choices"]:
                tokens.setdefault(choice["index"], []).extend(choice["token_ids"])
    else:
        tokens = {c["index"]: c["token_ids"] for c in out["json"]["choices"]}
    assert tokens == {k: list(expected) for k in range(4)}
    assert service.drain_status.ok and executor.state == "Stopped"
    assert service.active == 0 and service.sequences.counts()["in_use"] == 0


@pytest.mark.parametrize("n,stream", [(2, True), (2, False), (1, True), (1, False)])
def test_an_unexpected_error_in_one_choice_is_the_answer_not_a_short_success(tmp_path, n,
                                                                             stream):
    """A request one of whose choices meets an error this server did not foresee (a bug:
    here ``advance`` raising after that choice's first token) answers the error (500
    ``server.unexpected_error``; an SSE error event once chunks went out), as a whole answer
    of one choice did. Streamed with several choices, it ended with the usage chunk and
    ``[DONE]``: a success whose second choice stopped after one token with no
    ``finish_reason``; not streamed, the connection was reset; streamed with one choice, the
    connection was cut with no error event."""
    from test_server_support import started_executor

    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    service = app.state.service
    advance = service.advance
    seen: list[int] = []

    async def flaky(run):  # the second choice fails once it has a token
        if id(run) not in seen:
            seen.append(id(run))
        if seen.index(id(run)) == n - 1 and run.tokens:
            raise RuntimeError("a bug")
        return await advance(run)

    service.advance = flaky
    body = {"prompt": [5, 6, 7], "n": n, "max_tokens": 6, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    try:
        with ServeLikeServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=30) as http:
            if stream:
                with http.stream("POST", "/v1/completions", json=body) as r:
                    lines = [line for line in r.iter_lines() if line]
                assert r.status_code in (200, 500), (r.status_code, lines)
                last = json.loads(lines[-1][6:]) if r.status_code == 200 else \
                    json.loads(lines[-1])
                assert last["error"]["code"] == "server.unexpected_error", lines[-3:]
                assert "data: [DONE]" not in lines
            else:
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 500, r.text
                assert r.json()["error"]["code"] == "server.unexpected_error"
            metrics = http.get("/metrics").text
        assert metric_value(metrics, "calexec_request_failures_total",
                            {"code": "server.unexpected_error"}) == 1
        assert service.active == 0 and service.sequences.counts()["in_use"] == 0
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("point", ["HANG", "HANG+STALE_COMPLETION"])
def test_a_drain_meeting_a_hung_job_of_an_ended_request_ends_stopped(tmp_path, point):
    """A request cut at its deadline (504) leaves its job on the device, hung (FI: HANG); a
    drain then finds no request running and shut the executor down at once, which does not
    recover a hung job: it waited out the grace and ended Failed (``shutdown.not_drained``,
    ``calexec serve`` exit 3) though the fault controller recovers that job within its
    execution deadline. The drain now waits (within its grace) for the jobs of ended requests
    to leave the device, and ends Stopped (found by the "drain" schedules, seeds 8000-8005)."""
    from calexec.drivers.calrt.runtime import Fault, FaultMode

    executor = executor_for(tmp_path, False, 2000)  # execution deadline 0.5 s
    app = create_app(executor, ServerConfig(admin_token=TOKEN, max_sequences=6))
    service = app.state.service
    try:
        with ServeLikeServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=30) as http:
            for name in point.split("+"):
                assert executor.device.emu.set_fault(Fault[name], FaultMode.NTH, 1) == 0
            r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4,
                                                   "timeout": 0.2})
            assert r.status_code == 504, r.text
            assert service.releases_pending == 1  # its job is still on the device
            r = http.post("/admin/drain", params={"grace": 5}, headers=AUTH)
            assert r.status_code == 202, r.text
            end = time.monotonic() + 20
            while service.drain_status is None and time.monotonic() < end:
                time.sleep(0.02)
        assert service.drain_status is not None and service.drain_status.ok, \
            service.drain_status
        assert executor.state == "Stopped"
        assert len(executor.recoveries) == 1  # the hung job's, during the drain
        counts = service.sequences.counts()
        assert counts["in_use"] == 0 and counts["withheld"] == 0, counts
    finally:
        executor.device.emu.clear_all_faults()
        if not executor.lifecycle.final:
            executor.shutdown(5.0)
