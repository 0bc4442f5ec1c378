"""``calexec bench faults [--json] [--faults N] [--clients C] [--seed S] [--native-relay]``:
what a device fault
costs a client of the reference server with resumable generations (issue 16).

An in-process server (uvicorn on 127.0.0.1, an ephemeral port; the synthetic calbin on the
bundled emulator) serves ``--clients`` concurrent loopback clients, half of them streaming,
each sending completions back to back (half greedy, half sampled with a seed: sampling is a
pure function of the seed and the token index), while a seeded schedule injects
``--faults`` device faults one at a time, cycling through every retryable job-level kind
(CCU exception, NaN/Inf/short output, Wait failure, submit 17 busy and 18 unavailable, a hung
job, a hung job with a stale completion): arm the fault on the 1st-3rd next job, wait until it
fired, wait for Ready and until every request in flight during the fault ended (one fault at
a time, as the per-request resume budget assumes), next. Then every completed request is sent again, fault-free, for the
reference tokens. Reports client-visible errors (HTTP errors, SSE error events, transport
errors), the share of completed requests whose tokens equal the reference's (a replay that failed is
counted under ``reference_errors``, a real difference under ``tokens_mismatched`` with up to three
``mismatch_examples``), resumes per fault,
the added latency per fault (the longest pause a request resumed because of that fault saw:
its failure to its re-prefill's result) P50/P99, and the CPU model. ``--native-relay`` runs the
executor's submitter on its native relay (``ExecutorConfig.native_relay``, ``serve
--native-relay``), as ``bench soak --native-relay`` does: ``native_relay`` and
``relay_submitted`` (the steps it gave to infer from the relay) are in the report, with or
without it. Numbers are reported, never asserted (tests/test_bench_faults.py checks the
report's shape and correctness facts).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from calexec import cliargs

#: the retryable job-level faults (name, emulator fault points, rc): drivers/tools/chaos.py's list
#: without the reloads and the artifact faults (SetCsr / Slice failures are not retryable)
KINDS = ("ccu_exception", "output_nan", "output_inf", "output_short", "wait_rc",
         "submit_busy", "submit_unavailable", "hang", "hang_stale")
FIRE_WAIT_S = 10.0  # a fault that has not fired by then (no traffic reached it) is skipped
READY_WAIT_S = 30.0
REQUEST_TIMEOUT_S = 60.0
#: seconds between two progress lines of the reference replay on stderr
PROGRESS_S = 10.0


class BenchError(RuntimeError):
    pass


#: the bench executor's execution deadline (``ExecutorConfig.execution_timeout_s``): a hung
#: job is found and recovered well under a second
EXECUTION_TIMEOUT_S = 0.4


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


#: error kind (``HTTP 499 request.cancelled``, ``SSE error ...``) -> the first message seen
_EXAMPLES_MU = threading.Lock()


def http_error(r) -> tuple[str, str]:
    """(``HTTP <status> <error code>``, the error's message) from an OpenAI error body."""
    try:
        error = r.json().get("error") or {}
        code, message = error.get("code") or error.get("type"), str(error.get("message", ""))
    except (ValueError, AttributeError):
        code, message = None, r.text[:200]
    return f"HTTP {r.status_code}" + (f" {code}" if code else ""), message


def _request(http, body: dict[str, Any], examples: dict[str, str]
             ) -> tuple[list[int] | None, str | None]:
    """(tokens, None) of a completed request, or (None, what the client saw instead); the
    first message of each kind of error goes into ``examples``."""
    tokens, error, message = _attempt(http, body)
    if error is not None:
        with _EXAMPLES_MU:
            examples.setdefault(error, message)
    return tokens, error


def _attempt(http, body: dict[str, Any]) -> tuple[list[int] | None, str | None, str]:
    try:
        if not body["stream"]:
            r = http.post("/v1/completions", json=body)
            if r.status_code != 200:
                return (None, *http_error(r))
            return r.json()["choices"][0]["token_ids"], None, ""
        tokens: list[int] = []
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return (None, *http_error(r))
            done = False
            for line in r.iter_lines():
                if not line:
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    return (None, f"SSE error {event['error'].get('code')}",
                            str(event["error"].get("message", "")))
                tokens += event["choices"][0]["token_ids"]
        if done:
            return tokens, None, ""
        return None, "stream ended without [DONE]", f"{len(tokens)} tokens before the end"
    except Exception as err:  # noqa: BLE001 - a transport error is what the client saw
        return None, f"transport {type(err).__name__}", str(err)[:200]


def _client(url: str, index: int, seed: int, stop: threading.Event, out: list,
            current: list[float | None], examples: dict[str, str]) -> None:
    """Sends completions back to back until ``stop``; ``current[index]``: when the request in
    flight started (None between two requests)."""
    import httpx

    rng = random.Random(seed * 1000 + index)
    stream = index % 2 == 1  # half of the clients stream
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        while not stop.is_set():
            prompt = [rng.randrange(1, 150000) for _ in range(rng.randint(1, 16))]
            body = {"prompt": prompt, "max_tokens": rng.randint(4, 16), "stream": stream,
                    "timeout": REQUEST_TIMEOUT_S}
            if rng.random() < 0.5:  # half greedy, half sampled with a seed
                body.update(temperature=rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(1 << 31))
            current[index] = time.monotonic()
            tokens, error = _request(http, body, examples)
            current[index] = None
            out.append((body, tokens, error))


def wait_until(predicate, timeout: float) -> bool:
    """Poll ``predicate`` every 2 ms until it holds (True) or ``timeout`` s passed (False)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def bench_executor(workdir: Path, native_relay: bool = False, inflight_capacity: int = 1):
    """drivers/tools/chaos.py's executor (fast latency profile, no escalation to Failed) with a
    shorter execution deadline and drain grace: a hung job costs well under a second.
    ``native_relay``: ``ExecutorConfig.native_relay`` (``bench soak --native-relay``);
    ``inflight_capacity``: ``ExecutorConfig.inflight_capacity`` (``--inflight-capacity``, 2:
    Phase B, never downgraded: the schedule's faults would end it after two)."""
    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.drivers.synthetic import calbin
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecoveryPolicy

    path = str(workdir / "synthetic.calbin")
    calbin.write(path, calbin.default_spec())
    executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                              ExecutorConfig(
                                  calbin_path=path,
                                  device_config="decode_us=1500;prefill_per_token_us=50",
                                  execution_timeout_s=EXECUTION_TIMEOUT_S, timeout_grace_s=0.1,
                                  golden_timeout_s=5.0,
                                  recovery=RecoveryPolicy(max_recoveries=1_000_000,
                                                          drain_grace_s=0.2),
                                  native_relay=native_relay,
                                  inflight_capacity=inflight_capacity,
                                  # Phase B under a fault schedule: no downgrade to one job
                                  # in flight (two faults after submit would end Phase B
                                  # for the rest of the run), as no escalation to Failed
                                  downgrade_after_faults=1_000_000))
    status = executor.start()
    if not status.ok:
        busy = ""
        if status.code == "execution.deadline":  # (the start's golden job)
            busy = (f"; its golden job ran past this bench's execution deadline "
                    f"({EXECUTION_TIMEOUT_S:g} s, short so that a hung job costs little): "
                    "the host is too busy for it, run the bench again when it is quieter")
        raise BenchError(f"executor did not start: {status}{busy}")
    return executor


def run_fault_bench(faults: int, clients: int, seed: int, progress=None,
                    native_relay: bool = False, inflight_capacity: int = 1) -> dict[str, Any]:
    """One run; the report (module docstring). ``native_relay``: the executor's submitter on
    its native relay (``--native-relay``); ``inflight_capacity`` 2: Phase B
    (``--inflight-capacity``). ``progress(done, total, what)``: called after each
    fault (``what`` "faults") and each request of the fault-free reference replay ("reference
    requests")."""
    import httpx

    from calexec.drivers.calrt.runtime import Fault, FaultMode, bundled_emulator
    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.tools.bench.core import cpu_model
    from calexec.drivers.tools.chaos import FAULTS, LiveServer

    points = {name: (point, rc) for name, point, rc in FAULTS}
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="calexec-bench-faults-") as tmp:
        executor = bench_executor(Path(tmp), native_relay, inflight_capacity)
        app = create_app(executor, ServerConfig())
        service = app.state.service
        resumed: list[tuple[float, float, str]] = []
        service.resumer.on_resumed = lambda started, lost, cause: resumed.append(
            (started, lost, cause))
        emu = bundled_emulator(executor.device)
        records: list = []
        examples: dict[str, str] = {}  # client errors: kind -> first message
        ref_examples: dict[str, str] = {}  # the replay's errors
        windows: list[tuple[float, str]] = []  # (armed at, kind) of each fired fault
        skipped: Counter = Counter()
        stop = threading.Event()
        current: list[float | None] = [None] * clients
        t_start = time.monotonic()
        try:
            with LiveServer(app) as server:
                threads = [threading.Thread(target=_client, args=(server.url, i, seed, stop,
                                                                  records, current,
                                                                  examples),
                                            name=f"bench-faults-client-{i}")
                           for i in range(clients)]
                for thread in threads:
                    thread.start()
                order = list(KINDS)
                for i in range(faults):
                    if i % len(order) == 0:
                        rng.shuffle(order)
                    kind = order[i % len(order)]
                    if not wait_until(lambda: executor.state == "Ready" and not executor.health(),
                                 READY_WAIT_S):
                        raise BenchError(f"not Ready {READY_WAIT_S}s after a fault "
                                         f"(lifecycle {executor.state}: {executor.health()})")
                    # one fault at a time: every request in flight during the last one ended
                    ready_at = time.monotonic()
                    wait_until(lambda ready_at=ready_at: all(c is None or c >= ready_at
                                                        for c in current),
                          REQUEST_TIMEOUT_S)
                    point, rc = points[kind]
                    first = Fault[point.split("+")[0]]
                    armed = time.monotonic()
                    for name in point.split("+"):
                        emu.set_fault(Fault[name], FaultMode.NTH, rng.randint(1, 3),
                                      rng.randrange(1 << 30), rc)
                    fired = wait_until(lambda first=first: emu.fault_stats(first)[2] >= 1,
                                       FIRE_WAIT_S)
                    emu.clear_all_faults()
                    if fired:
                        windows.append((armed, kind))
                    else:
                        skipped[kind] += 1
                    if progress is not None:
                        progress(i + 1, faults, "faults")
                wait_until(lambda: executor.state == "Ready" and not executor.health(),
                      READY_WAIT_S)
                stop.set()
                for thread in threads:
                    thread.join(REQUEST_TIMEOUT_S + 10)
                faulted_s = time.monotonic() - t_start
                # the reference: every completed request again, fault-free, not streamed
                done = [(body, tokens) for body, tokens, error in records if error is None]
                reference: dict[int, tuple[list[int] | None, str | None]] = {}
                todo = iter(range(len(done)))
                lock = threading.Lock()

                replayed = [0]

                def replay() -> None:
                    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
                        while True:
                            with lock:
                                k = next(todo, None)
                            if k is None:
                                return
                            reference[k] = _request(http, {**done[k][0], "stream": False},
                                                    ref_examples)
                            if progress is not None:  # (the replay is the longer part)
                                with lock:
                                    replayed[0] += 1
                                    progress(replayed[0], len(done), "reference requests")
                replayers = [threading.Thread(target=replay) for _ in range(clients)]
                for thread in replayers:
                    thread.start()
                for thread in replayers:
                    thread.join(REQUEST_TIMEOUT_S * 4)
                metrics = service.metrics
                budget_exhausted = metrics.registry.get_sample_value(
                    "calexec_resume_budget_exhausted_total") or 0.0
                service_sequences = service.sequences.counts()
                # steps the submitter gave to infer from its native relay (--native-relay)
                relay_submitted = int(executor.snapshot().get("relay_submitted", 0))
                # Phase B's automatic downgrades to one job in flight (faults after submit)
                downgrades = int(executor.snapshot().get("downgrades", 0))
                capacity_end = int(executor.snapshot().get("inflight_capacity", 0))
        finally:
            stop.set()
            emu.clear_all_faults()
            if not executor.lifecycle.final:
                executor.shutdown(10.0)
    # a replay that failed (or never ran) is no reference: counted apart, never as identical
    missing = (None, "replay did not run")
    ref_errors = Counter(reference.get(k, missing)[1] for k in range(len(done))
                         if reference.get(k, missing)[1] is not None)
    same = [reference.get(k, missing)[0] == tokens for k, (_, tokens) in enumerate(done)]
    mismatched = [k for k in range(len(done))
                  if reference.get(k, missing)[1] is None and not same[k]]
    identical = sum(same)
    sampled = [k for k, (body, _) in enumerate(done) if "seed" in body]
    identical_sampled = sum(1 for k in sampled if same[k])
    errors = Counter(error for _, _, error in records if error is not None)
    # attribute each resume to the fault armed last before its failure
    per_fault: dict[int, float] = {}
    starts = [armed for armed, _ in windows]
    for started, lost, _ in resumed:
        k = max((j for j, armed in enumerate(starts) if armed <= started), default=None)
        if k is not None:
            per_fault[k] = max(per_fault.get(k, 0.0), lost)
    added_ms = [v * 1000 for v in per_fault.values()]
    n_fired = len(windows)
    return {
        "faults_requested": faults, "faults_fired": n_fired,
        "faults_by_kind": dict(Counter(kind for _, kind in windows)),
        "faults_not_fired": dict(skipped),
        "clients": clients, "streaming_clients": clients // 2, "seed": seed,
        "requests": len(records), "completed": len(done),
        "client_errors": sum(errors.values()), "errors": dict(errors),
        "error_examples": examples,
        "tokens_identical_pct": round(100.0 * identical / len(done), 3) if done else None,
        "tokens_mismatched": len(mismatched),
        "mismatch_examples": [{"request": done[k][0], "tokens": done[k][1],
                               "reference": reference[k][0]} for k in mismatched[:3]],
        "reference_errors": dict(ref_errors),
        "reference_error_examples": ref_examples,
        "completed_sampled": len(sampled),
        "tokens_identical_pct_sampled": round(100.0 * identical_sampled / len(sampled), 3)
        if sampled else None,
        "resumes": len(resumed), "resumes_by_cause": dict(Counter(c for _, _, c in resumed)),
        "resumes_per_fault": round(len(resumed) / n_fired, 3) if n_fired else None,
        "faults_with_a_resume": len(per_fault),
        "added_latency_per_fault_ms": {
            "p50": _round(_pct(added_ms, 50)),
            "p99": _round(_pct(added_ms, 99)),
            "max": None if not added_ms else round(max(added_ms), 3)},
        "resume_budget_exhausted": int(budget_exhausted),
        "recoveries": len(executor.recoveries),
        "native_relay": native_relay, "relay_submitted": relay_submitted,
        "inflight_capacity": inflight_capacity, "downgrades": downgrades,
        "inflight_capacity_end": capacity_end,
        "sequences_at_end": service_sequences,
        "seconds_with_faults": round(faulted_s, 3),
        "cpu_model": cpu_model(), "cpus": os.cpu_count(),
    }


@cliargs.command_main
def main(argv: list[str]) -> int:
    parser = cliargs.parser("calexec bench faults", __doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--faults", type=cliargs.count("bench faults --faults"), default=100,
                        help="device faults to inject, one at a time (1000: the issue's "
                             "figure; at most "
                             f"{cliargs.MAX_COUNTS['bench faults --faults']})")
    parser.add_argument("--clients", type=cliargs.clients, default=6,
                        help="concurrent loopback clients; half of them stream")
    parser.add_argument("--seed", type=cliargs.non_negative_int, default=16,
                        help="seed of the schedule and prompts")
    parser.add_argument("--native-relay", action="store_true",
                        help="the executor's submitter on its native relay "
                             "(ExecutorConfig.native_relay, serve --native-relay)")
    cliargs.add_inflight_capacity(parser)
    args = parser.parse_args(argv[2:])

    said = {"faults": 0.0, "reference requests": 0.0}

    def progress(done: int, total: int, what: str) -> None:
        # every 50 faults; the replay (every completed request again, minutes with many
        # clients, silent before) every PROGRESS_S; each part's last one always
        now = time.monotonic()
        due = done % 50 == 0 if what == "faults" else now - said[what] >= PROGRESS_S
        if due or done == total or (what != "faults" and done == 1):
            said[what] = now
            print(f"bench faults: {done}/{total} {what}", file=sys.stderr)
    try:
        result = run_fault_bench(args.faults, args.clients, args.seed, progress,
                                 args.native_relay, args.inflight_capacity)
    except BenchError as exc:
        print(f"calexec bench faults: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
