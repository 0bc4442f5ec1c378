"""Threaded fault soak of the reference server (issue 13; ``tests/test_chaos.py`` runs it for
a few seconds in the suite, ``calexec accept --gates chaos`` as long as asked).

``run_chaos`` serves a started executor (bundled emulator, synthetic calbin) on a loopback port
with uvicorn and drives it with ``clients`` concurrent clients (plain and streaming
completions, early disconnects, short timeouts) while a seeded schedule injects every
job-level emulator fault kind, hung jobs, good and refused reloads (and a reload whose new
generation cannot map its buffers), then drains. It returns the run's figures and the list of
``problems`` and ``wrong`` tokens found:

* a token that differs from the numpy oracle's greedy continuation (``wrong``);
* a response later than the request deadline plus ``ServerConfig.deadline_slack_s`` as the
  server measures it (its dump records); only a request the server kept no record of is
  judged by its client's clock, with ``HARNESS_ALLOWANCE_S`` more for the client's own GIL
  share;
* an undocumented HTTP status, an error without a JSON body, a stream that ended without
  ``[DONE]`` or an SSE error event;
* free + in-use + withheld sequence ids != capacity at any step, any id not free or any slot
  leased or in flight when idle;
* ``/ready`` not 200 again within ``RECOVERY_BOUND_S`` after a scheduled fault;
* a drain that does not end Stopped.

Needs the ``[server]`` extra (FastAPI, uvicorn, httpx).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import json
import random
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers.calrt.runtime import CalRT, Fault, FaultMode, bundled_emulator
from calexec.drivers.serving.dumpsink import DumpSink
from calexec.drivers.serving.executor_view import served
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.synthetic import calbin, oracle
from calexec.drivers.tools import chaos_clients
from calexec.drivers.tools.answers import answer_wrong
from calexec.drivers.tools.chaos_clients import Record
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.faults import RecoveryPolicy

RECOVERY_BOUND_S = 20.0  # a hung job: execution deadline + grace + drain + reset + golden
#: what a client measures includes its own process's scheduling on a loaded host (the clients
#: run in a process of their own, ``_Clients``, since stop 69; before, in the server's, their
#: threads took the server's GIL too): it may exceed what the server took by this much. The
#: server-side latency (dump records: admission to answer) is held to deadline + slack alone,
#: and judges every request that has one: the client's clock then measures the host's
#: scheduling of the harness (a loaded host put a client's answer 1.6 s past a 0.085 s
#: deadline the server met by 0.07 s), and judges only a request the server kept no record of.
HARNESS_ALLOWANCE_S = 1.0
TOKEN = "chaos-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOCUMENTED = {200, 429, 500, 503, 504}  # docs/server.md "Errors" (400s: none sent here)

#: the schedule's actions: (name, emulator fault point or None, rc)
FAULTS = [("ccu_exception", "CCU_EXCEPTION", 0), ("output_nan", "OUTPUT_NAN", 0),
          ("output_inf", "OUTPUT_INF", 0), ("output_short", "OUTPUT_SHORT", 0),
          ("wait_rc", "WAIT_RC", 0), ("submit_busy", "SUBMIT_RC", 17),
          ("submit_unavailable", "SUBMIT_RC", 18), ("hang", "HANG", 0),
          ("hang_stale", "HANG+STALE_COMPLETION", 0), ("can_allocate_false",
                                                       "CAN_ALLOCATE_FALSE", 0),
          ("apply_false", "APPLY_FALSE", 0), ("unknown_csr", "UNKNOWN_CSR", 0),
          ("slice_fail", "SLICE_FAIL", 0)]
RELOADS = ["reload_good", "reload_corrupt", "reload_map_fail"]
ACTIONS = tuple(f[0] for f in FAULTS) + tuple(RELOADS)


@functools.lru_cache(maxsize=4096)
def oracle_tokens(prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The numpy oracle's greedy continuation of ``prompt``: ``n`` tokens (cached)."""
    ref = oracle.OracleSequence(calbin.DEFAULT_SEED)
    ref.run(list(prompt))
    out = [ref.next_token()]
    for _ in range(n - 1):
        ref.run([out[-1]])
        out.append(ref.next_token())
    return tuple(out)


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 (ephemeral port) in a background thread named
    ``name``."""

    def __init__(self, app, name: str = "uvicorn-chaos") -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        _wait_for(lambda: self.server.started, 30, "uvicorn startup")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.loop = self.server.servers[0].get_loop()  # the loop serving the app
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def chaos_executor(workdir: Path, inflight_capacity: int = 1) -> DeviceExecutor:
    """The executor the soak drives: the synthetic calbin on the bundled emulator with a fast
    latency profile, short execution deadlines (hung jobs recover in about a second) and no
    escalation to Failed (the schedule injects hundreds of faults on purpose)."""
    path = str(workdir / "synthetic.calbin")
    calbin.write(path, calbin.default_spec())
    executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                              ExecutorConfig(
                                  calbin_path=path, inflight_capacity=inflight_capacity,
                                  device_config="decode_us=1500;prefill_per_token_us=50",
                                  execution_timeout_s=1.0, timeout_grace_s=0.2,
                                  golden_timeout_s=5.0,
                                  recovery=RecoveryPolicy(max_recoveries=100_000,
                                                          drain_grace_s=1.0)))
    status = executor.start()
    if not status.ok:
        raise RuntimeError(f"executor did not start: {status}")
    return executor


#: where a thread waits for another: CPython's own waits (``Event.wait``, ``Condition.wait``,
#: ``Thread.join``, a semaphore, a queue, a ``concurrent.futures`` result), by (file name,
#: function): an event loop found in one is blocked on its own thread, not starved of CPU
#: (``LoopLag``). Not the wait of ``Thread.start`` (anyio's new worker thread; until stop 70
#: also a burst's and a background release's) for the new thread to run once: it waits for
#: the host's scheduler, which is what the loop's lag excuses
BLOCKING_WAITS = frozenset({
    ("threading.py", "wait"), ("threading.py", "join"), ("threading.py", "acquire"),
    ("threading.py", "_wait_for_tstate_lock"), ("queue.py", "get"), ("queue.py", "put"),
    ("_base.py", "result"), ("_base.py", "wait")})


def blocking_wait(frame: Any) -> str | None:
    """Where the stack ending in ``frame`` (a thread's, ``sys._current_frames``) waits in one
    of ``BLOCKING_WAITS``: ``"file:line in caller (waits in threading.wait)"``, the first
    caller outside the waits' own files; None when it waits in none (running, in the
    selector's ``select``: an idle event loop, or in ``Thread.start``)."""
    wait = None
    while frame is not None:
        code = frame.f_code
        name = (Path(code.co_filename).name, code.co_name)
        if wait is None:
            if name in BLOCKING_WAITS:
                wait = f"{Path(name[0]).stem}.{name[1]}"
        elif name == ("threading.py", "start"):
            return None
        elif name[0] not in {file for file, _ in BLOCKING_WAITS}:
            return f"{code.co_filename}:{frame.f_lineno} in {code.co_name} (waits in {wait})"
        frame = frame.f_back
    return None if wait is None else f"(waits in {wait})"


def _handed_at(sample: tuple[float, float]) -> float:
    return sample[0]


class LoopLag:
    """How late the server's event loop runs what it is handed: every ``every_s`` a thread of
    the harness hands the loop a callback stamped with the time it was handed, and the loop
    notes when it ran it. A host short of CPU (a loaded CI runner) leaves the loop behind the
    work it was handed: an answer due at a request's deadline then goes out as late as the
    loop is, however promptly the server's own deadline fired. The soak holds a late answer
    to its deadline + slack + the loop's lag meanwhile (``worst``), and reports the lag; a
    wait the server does not bound still shows as lateness beyond it.

    A loop that blocks on its own thread (a wait for a job, a lock, a thread: a defect of the
    server) is late the same way, so while a callback is late the probe also looks at the
    loop thread's stack: found in a blocking wait (``blocking_wait``), that moment is noted in
    ``blocked``, the wait lasts (``waits``) until the loop next runs a callback, and a
    callback late across a wait excuses nothing (``worst``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, every_s: float = 0.01) -> None:
        self.loop, self.every_s = loop, every_s
        self.samples: list[tuple[float, float]] = []  # (handed at, ran that much later)
        self.handed = 0  # callbacks handed so far
        self.ran = 0  # of those, run by the loop
        #: (when, where): the loop thread found in a blocking wait while a callback was late
        self.blocked: list[tuple[float, str]] = []
        #: (first found blocked, the loop ran a callback again): the loop's blocking waits
        self.waits: list[tuple[float, float]] = []
        self._waiting_since: float | None = None  # found blocked, not run since
        self.loop_thread: int | None = None  # the loop's thread (once a callback ran)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-loop-lag", daemon=True)

    def _ran(self, handed: float) -> None:
        now = time.monotonic()
        self.loop_thread = threading.get_ident()
        self.samples.append((handed, now - handed))
        self.ran += 1
        since = self._waiting_since
        if since is not None:  # the loop was found blocked before this ran: the wait ended
            self._waiting_since = None
            self.waits.append((since, now))

    def _look(self) -> None:
        """(The probe's thread, a callback late.) Where the loop thread is, noted when it
        waits."""
        ident = self.loop_thread
        frame = None if ident is None else sys._current_frames().get(ident)
        where = blocking_wait(frame)
        if where is not None:
            now = time.monotonic()
            self.blocked.append((now, where))
            if self._waiting_since is None:
                self._waiting_since = now

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.ran < self.handed:  # one handed at least every_s ago has not run
                self._look()
            try:
                self.loop.call_soon_threadsafe(self._ran, time.monotonic())
                self.handed += 1
            except RuntimeError:  # the loop closed
                return

    def __enter__(self) -> LoopLag:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def worst(self, start: float, end: float) -> float:
        """The largest lag of a callback handed to the loop in [``start``, ``end``] and not
        late across one of the loop's blocking waits (``waits``; one not ended yet lasts on):
        what the host's scheduling excuses (0.0: none). Only the window's samples are read
        (found by bisection): the soak asks once per request, and a full run's 1800 s hold
        180,000 samples (a scan of them all per request took minutes)."""
        waits = list(self.waits)
        if self._waiting_since is not None:
            waits.append((self._waiting_since, float("inf")))
        samples = self.samples  # (in the order handed: the loop runs them in that order)
        first = bisect.bisect_left(samples, start, key=_handed_at)
        last = bisect.bisect_right(samples, end, lo=first, key=_handed_at)
        return max((lag for handed, lag in samples[first:last]
                    if not any(handed <= freed and handed + lag >= since
                               for since, freed in waits)),
                   default=0.0)


class _Clients:
    """The soak's clients in a process of their own (``chaos_clients``; loopback only): their
    16 threads in the server's process competed with it for the GIL, and a loaded host's
    scheduling of them put the server's own answer (its dump record) past deadline + slack.
    ``finish()`` ends them: the records, the clients still running, what went wrong with the
    process itself or ended a client early (a client's thread that died: its traceback went
    to the process's stderr, read only when it failed, and its requests just stopped)."""

    def __init__(self, url: str, clients: int, seed: int, bound_s: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "calexec.drivers.tools.chaos_clients", url, str(clients),
             str(seed), str(bound_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.bound_s = bound_s

    def __enter__(self) -> _Clients:
        ready: list[str] = []
        stdout = self.proc.stdout
        if stdout is None:  # (PIPE gives one)
            raise RuntimeError("the chaos clients' process has no stdout")
        reader = threading.Thread(target=lambda: ready.append(stdout.readline()),
                                  name="chaos-clients-start", daemon=True)
        reader.start()
        reader.join(30)
        if ready != ["started\n"]:
            self.proc.kill()
            err = self.proc.communicate(timeout=30)[1]
            raise RuntimeError(f"the chaos clients did not start ({ready}): {err[-2000:]}")
        return self

    def finish(self) -> tuple[list[Record], int, list[str]]:
        try:
            out, err = self.proc.communicate(input="", timeout=self.bound_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate(timeout=30)
        lines = out.splitlines()
        trouble = [] if self.proc.returncode == 0 else [
            f"the chaos clients' process ended with {self.proc.returncode}: {err[-2000:]}"]
        try:
            last: dict[str, Any] = json.loads(lines[-1]) if lines else {"alive": 0,
                                                                        "crashed": []}
            alive = int(last["alive"])
            trouble += [f"a chaos client ended before the soak: {what}"
                        for what in last["crashed"]]
            records = [chaos_clients.record_of(json.loads(line)) for line in lines[:-1]]
        except (ValueError, KeyError, TypeError) as exc:
            return [], 0, [*trouble, f"the chaos clients' output unreadable: {exc!r}"]
        return records, alive, trouble

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:  # (an error before finish): nothing is left running
            self.proc.kill()
            self.proc.communicate(timeout=30)


def check_record(rec: Record, slack: float, server_s: float | None, problems: list[str],
                 wrong: list[str], loop_lag_s: float = 0.0) -> None:
    """Adds what is wrong with one record to ``problems`` / ``wrong`` (wrong tokens).
    ``server_s``: the server-side latency of the request (its dump record), if admitted.
    ``loop_lag_s``: how late the server's event loop ran what it was handed while the request
    was past its deadline (``LoopLag.worst``): an answer is not held to be sooner than the
    loop could run it."""
    where = f"{rec.kind} prompt={rec.prompt} max_tokens={rec.max_tokens}"
    if rec.error is not None:
        problems.append(f"{where}: transport error {rec.error}")
        return
    if rec.kind != "disconnect" and (
            server_s > rec.timeout + slack + loop_lag_s if server_s is not None
            else rec.end - rec.start > rec.timeout + slack + HARNESS_ALLOWANCE_S + loop_lag_s):
        problems.append(f"{where}: answered {rec.end - rec.start - rec.timeout:.3f}s after "
                        f"its {rec.timeout:.3f}s deadline (server-side {server_s}s; slack "
                        f"{slack}s; the event loop ran {loop_lag_s:.3f}s late meanwhile)")
    if rec.code not in DOCUMENTED:
        problems.append(f"{where}: undocumented HTTP {rec.code}: {rec.body}")
        return
    expected = oracle_tokens(tuple(rec.prompt), rec.max_tokens)
    if rec.code != 200:
        error = (rec.body or {}).get("error", {})
        if not error.get("code") or rec.body.get("status", {}).get("http_status") != rec.code:
            problems.append(f"{where}: HTTP {rec.code} without a JSON error body: {rec.body}")
        return
    if rec.body is not None:  # a plain completion
        choice = rec.body["choices"][0]
        tokens = choice["token_ids"]
        # (an answer cut short with "stop", or no finish_reason, passed until stop 72)
        if answer_wrong(tokens, choice.get("finish_reason"), list(expected), rec.max_tokens):
            wrong.append(f"{where}: {tokens} finish {choice.get('finish_reason')} != oracle "
                         f"{list(expected)}")
        return
    tokens, ended, finish = [], None, None
    for line in rec.events:
        data = line[len("data: "):]
        if data == "[DONE]":
            ended = "done"
            continue
        event = json.loads(data)
        if "error" in event:
            ended = "error"
            if not event["error"].get("code"):
                problems.append(f"{where}: SSE error event without a code: {event}")
            continue
        tokens += event["choices"][0]["token_ids"]
        finish = event["choices"][0].get("finish_reason") or finish
    if tuple(tokens) != expected[:len(tokens)]:
        wrong.append(f"{where}: streamed {tokens} != oracle {list(expected)}")
    elif ended == "done" and answer_wrong(tokens, finish, list(expected), rec.max_tokens):
        # (until stop 72 "stop" took any length: an answer cut short and said "stop" passed)
        wrong.append(f"{where}: {len(tokens)} tokens, finish {finish}")
    if rec.kind == "stream" and ended is None:
        problems.append(f"{where}: the stream ended without [DONE] or an SSE error event")


def _idle(executor: DeviceExecutor, service: Any) -> bool:
    """Every request ended and gave back what it held: what the soak's end checks, all of it
    (the job's count left the dispatch before the completion thread gave its slot back: a
    snapshot between the two read a slot in flight with no job, stop 69)."""
    if (service.active or service.releases_pending or service.sequences.in_use
            or executor.health()):
        return False
    snap = executor.snapshot()
    slots = snap["slots"] or {}
    return not (snap["inflight"] or snap["queued"] or snap["completing"]
                or slots.get("Leased", 0) or slots.get("InFlight", 0))


def _diagnose(executor, service) -> dict:
    """What a server that does not go idle still holds."""
    live = [{"request": run.request_id, "seq": run.seq_id, "done": run.done,
             "closed": run.closed, "enqueue_idle": run.enqueue_idle.is_set(),
             "handle": None if run.handle is None else repr(run.handle)}
            for run in service.live_requests()]
    return {"active": service.active, "releases_pending": service.releases_pending,
            "sequences": service.sequences.counts(), "lifecycle": executor.state,
            "health": executor.health(), "snapshot": executor.snapshot(), "live": live[:8],
            "threads": sorted(t.name for t in threading.enumerate())}


def arm_fault(emu, point: str, rng: random.Random, rc: int) -> None:
    """Arm one schedule action's emulator fault point(s) on one of the next 1-3 calls."""
    for name in point.split("+"):
        rc_set = emu.set_fault(Fault[name], FaultMode.NTH, rng.randint(1, 3),
                               rng.randrange(1 << 30), rc)
        if rc_set != 0:
            raise RuntimeError(f"emulator refused fault {name} (rc {rc_set})")


def run_chaos(workdir: Path, seconds: float = 6.0, clients: int = 16, seed: int = 13,
              actions: tuple[str, ...] = ACTIONS, inflight_capacity: int = 1,
              progress=None) -> dict[str, Any]:
    """One soak; returns its figures with ``problems`` and ``wrong`` (lists of strings; both
    empty when every rule held). ``progress(done_s, total_s)`` is called between steps."""
    unknown = sorted(set(actions) - set(ACTIONS))
    if unknown:
        raise ValueError(f"unknown chaos action(s) {unknown}; known: {list(ACTIONS)}")
    workdir = Path(workdir)
    executor = chaos_executor(workdir, inflight_capacity)
    idle: dict[str, Any] = {}
    final_ready = None
    if executor.gen is None:  # (chaos_executor started it)
        raise RuntimeError("the chaos executor has no generation")
    main = executor.gen.calbin_path
    good = str(workdir / "copy.calbin")
    shutil.copyfile(main, good)  # the same model at another path: a switch keeps the oracle
    corrupt = workdir / "corrupt.calbin"
    corrupt.write_bytes(b"corrupt calbin " * 64)
    config = ServerConfig(admin_token=TOKEN)
    # one dump record per request: its server-side latency tells a late answer's handler time
    # from the time it waited for the event loop or the socket
    dump = DumpSink(workdir / "dump", max_bytes=256 << 20, include_content=True)
    app = create_app(served(executor), config, dump)
    service = app.state.service
    emu = bundled_emulator(executor.device)
    rng = random.Random(seed)
    records: list[Record] = []
    steps: list[dict] = []
    problems: list[str] = []
    stop = threading.Event()
    try:
        with LiveServer(app) as server, LoopLag(server.loop) as lag, \
                _Clients(server.url, clients, seed, seconds + RECOVERY_BOUND_S + 60) as load:
            with httpx.Client(base_url=server.url, timeout=30) as admin:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    action = rng.choice(actions)
                    t0 = time.monotonic()
                    if action.startswith("reload"):
                        if action == "reload_map_fail":
                            emu.set_fault(Fault.MAP_FAIL, FaultMode.NTH, 1)
                        path = str(corrupt) if action == "reload_corrupt" else \
                            rng.choice([main, good])
                        r = admin.post("/admin/reload", json={"calbin": path}, headers=AUTH)
                        # a corrupt calbin is refused before the lifecycle moves (400
                        # calbin.invalid, DeviceExecutor.check_calbin); 503 while unhealthy
                        allowed = (400, 503) if action == "reload_corrupt" else (200, 500, 503)
                        if r.status_code not in allowed or "error" not in r.json() \
                                and r.status_code != 200:
                            problems.append(f"{action}: HTTP {r.status_code} {r.text[:300]}")
                    else:
                        _, point, rc = next(f for f in FAULTS if f[0] == action)
                        arm_fault(emu, point, rng, rc)
                        stop.wait(rng.uniform(0.2, 0.5))  # let the traffic meet it
                    ready_at = None
                    deadline = time.monotonic() + RECOVERY_BOUND_S
                    while time.monotonic() < deadline:
                        if admin.get("/ready").status_code == 200:
                            ready_at = time.monotonic()
                            break
                        stop.wait(0.02)
                    emu.clear_all_faults()
                    if progress is not None:
                        progress(time.monotonic() + seconds - end, seconds)
                    steps.append({"action": action, "ready_after_s": None if ready_at is None
                                  else round(ready_at - t0, 3)})
                    if ready_at is None:
                        problems.append(f"{action}: /ready not 200 within {RECOVERY_BOUND_S}s "
                                        f"(lifecycle {executor.state}, health "
                                        f"{executor.health()})")
                        break
                    if not service.sequences.consistent():
                        problems.append(f"{action}: sequence ids {service.sequences.counts()}")
                stop.set()
                records, alive, trouble = load.finish()
                if alive:
                    problems.append(f"{alive} client(s) never returned")
                problems.extend(trouble)
                emu.clear_all_faults()
                # idle: every request ended, every id free, no slot leased or in flight
                try:
                    # (a fault armed late may still be recovering: idle includes Ready again)
                    _wait_for(lambda: _idle(executor, service), timeout=30,
                              what="the server to go idle")
                except TimeoutError as err:
                    problems.append(f"{err}: {_diagnose(executor, service)}")
                snap = executor.snapshot()
                slots = snap["slots"] or {}
                idle = {"sequences": service.sequences.counts(), "inflight": snap["inflight"],
                        "queued": snap["queued"], "leased": slots.get("Leased", 0),
                        "in_flight_slots": slots.get("InFlight", 0)}
                final_ready = admin.get("/ready").status_code
                r = admin.post("/admin/drain", params={"grace": 10}, headers=AUTH)
                if r.status_code != 202:
                    problems.append(f"drain: HTTP {r.status_code} {r.text[:300]}")
                _wait_for(lambda: service.drain_status is not None, timeout=30, what="drain")
    finally:
        stop.set()
        emu.clear_all_faults()
        if not executor.lifecycle.final:
            executor.shutdown(5.0)
    server_latency: dict[tuple, list[float]] = {}
    for line in dump.path.read_text().splitlines() if dump.path.exists() else []:
        entry = json.loads(line)
        server_latency.setdefault(tuple(entry["prompt_token_ids"]), []).append(
            entry["latency_s"])
    wrong: list[str] = []
    excused = 0
    for rec in records:
        server_s = max(server_latency.get(tuple(rec.prompt), [None]) or [None],
                       key=lambda v: -1 if v is None else v)
        # the loop's lag from the request's deadline to its answer (client-side times: one
        # machine-wide monotonic clock)
        lags = lag.worst(rec.start + rec.timeout, rec.end)
        excused += (server_s is not None and rec.kind != "disconnect"
                    and rec.timeout + config.deadline_slack_s < server_s
                    <= rec.timeout + config.deadline_slack_s + lags)
        check_record(rec, config.deadline_slack_s, server_s, problems, wrong, lags)
    late = [rec.end - rec.start - rec.timeout for rec in records if rec.kind != "disconnect"
            and rec.error is None]
    server_late = [max(server_latency.get(tuple(rec.prompt), [0.0])) - rec.timeout
                   for rec in records if rec.kind != "disconnect"]
    figures = {
        "seed": seed, "seconds": seconds, "clients": clients, "requests": len(records),
        "by_status": dict(Counter(str(rec.code) for rec in records)),
        "by_kind": dict(Counter(rec.kind for rec in records)),
        "schedule_steps": len(steps), "actions": dict(Counter(s["action"] for s in steps)),
        "max_ready_after_s": max((s["ready_after_s"] or 0 for s in steps), default=0),
        "recoveries": len(executor.recoveries), "wrong_tokens": len(wrong),
        "max_past_deadline_s": round(max(late, default=0.0), 3),
        "p99_past_deadline_s": round(sorted(late)[int(0.99 * (len(late) - 1))], 3) if late
        else 0.0,
        "max_server_side_past_deadline_s": round(max(server_late, default=0.0), 3),
        # the event loop's lag (``LoopLag``): its worst, and the answers late past deadline +
        # slack by no more than it
        "max_loop_lag_s": round(lag.worst(float("-inf"), float("inf")), 3),
        "late_within_loop_lag": excused,
        # the loop thread found in a blocking wait while late (its lag excused nothing)
        "loop_blocked": len(lag.blocked),
        "loop_blocked_at": sorted({where for _, where in lag.blocked})[:5],
        "slack_s": config.deadline_slack_s, "idle": idle, "final_ready": final_ready,
        "drain": service.drain_status.code, "lifecycle": executor.state,
    }
    checks = idle.get("sequences") or {}
    if not service.sequences.consistent():
        problems.append(f"sequence ids inconsistent at the end: {service.sequences.counts()}")
    if checks and (checks["free"] != checks["capacity"] or checks["withheld"]):
        problems.append(f"not every sequence id free when idle: {checks}")
    if any(idle.get(k) for k in ("inflight", "queued", "leased", "in_flight_slots")):
        problems.append(f"work left when idle: {idle}")
    if final_ready != 200:
        problems.append(f"/ready {final_ready} when idle")
    if service.drain_status is None or not service.drain_status.ok or \
            executor.state != "Stopped":
        problems.append(f"drain ended {service.drain_status} in {executor.state}")
    if not records or not steps:
        problems.append("no request or no schedule step ran")
    return {**figures, "problems": problems, "wrong": wrong}
