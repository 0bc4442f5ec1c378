"""``calexec bench server [--json] [--requests N] [--max-tokens M] [--decode-us US]
[--concurrency C[,C...]] [--rounds R] [--gil-switch-us US] [--loadgen process|thread]
[--client stdlib|httpx] [--no-stream]``.

The reference server's own overhead (issues 6 and 28): the same bounded request load, a short
prompt then ``max_tokens`` greedy tokens per request, sent (a) over loopback HTTP to the server
(uvicorn on 127.0.0.1, an ephemeral port) by a load generator in a process of its own
(``loadgen.py``; ``--loadgen thread`` runs it in this process's threads, as before issue 28,
where it shared the server's GIL), not streaming and streaming (server-sent events), and
(b) straight into the in-process executor the server embeds, at each concurrency level
(default 1, 8 and 64), on the same emulated device profile, in one run. Reports requests/s and
request latency P50/P99 for each and their ratios. A further side, ``server_no_ahead``, is the
same server with ``ServerConfig.greedy_ahead`` off (each decode step fired by the request's own
loop instead of by the executor's completion thread), so the run shows what greedy ahead buys
over HTTP (``ahead_p50_ratio``: server / server_no_ahead); ``server_always_prearm`` the
same server pre-arming whatever the device's speed (``ServerConfig.prearm_min_device_ms`` 0:
what that policy buys at this profile, ``prearm_policy_throughput_ratio``: server /
server_always_prearm); ``server_no_bursts`` the same server with
``ServerConfig.decode_bursts`` off (the loop wakes once per token; what the bursts buy,
``burst_throughput_ratio``: server / server_no_bursts); and ``server_thread_waits`` the
no-bursts server with ``ServerConfig.inline_waits`` off too (a worker thread per enqueue and
per wait: what the inline waits buy, ``inline_throughput_ratio``: server_no_bursts /
server_thread_waits). ``api_process_floor`` is the ceiling of an API process split (vLLM's
layout; ``api_floor.py``): HTTP and a minimal completions route in a process of their own,
each request sent over a Unix socket to this process, which runs it as the direct side does
(``api_process_floor_ratio``: its requests/s over the direct side's; an upper bound for that
layout, not a server that exists: admission, resumes, bursts and metrics are left out; a
first request checks that it answers the direct side's tokens). Numbers are reported, never
asserted.

The compared sides, ``direct``, ``server``, ``server_stream``, ``server_stream_no_bursts``
(``ServerConfig.stream_bursts`` off: what the streamed bursts buy,
``stream_burst_throughput_ratio`` and ``stream_burst_cpu_ratio``: server_stream / it) and
``api_process_floor``, run interleaved: each level runs ``--rounds`` rounds (default 4; fewer when a block would hold
fewer than 4 requests per client), a block of each side per round, their order rotated, and
each side's figures pool its blocks (``round_throughput_ratios``: server / direct per round). A host whose speed drifts
during the run (this 2-core VM's does) shifts every side alike instead of the side that
happened to run last. The other sides run one block each, after them. The run applies the
process policy ``calexec serve`` applies (glibc's mmap threshold pinned,
``mmap_threshold_pinned``; the GIL switch interval ``--gil-switch-us``, default
500 us, ``gil_switch_interval_us``), so the server is measured as deployed; the direct side
runs under the same policy, each sequence with its own logits row (no allocation per token).

Each block of ``direct``, ``server``, ``server_stream`` and ``server_stream_no_bursts`` records this process's CPU time
(``time.process_time``: every thread, user and system) over the requests it served, warm-up
included: ``cpu_ms_per_request``, and ``cpu_per_request_ratio`` / ``stream_cpu_per_request_ratio``
(server / direct). With the load generator in a process of its own that is the server's and the
executor's CPU per request against the executor's alone: the server's share as CPU, which a
host's wake-up latency moves much less than it moves requests/s. ``--loadgen thread`` counts
the load generator's CPU too (``process_cpu_scope`` says which). The same blocks also account
the CPU per thread role (``threadcpu.py``, Linux): ``cpu_ms_per_request_by_thread`` per side
and ``server_minus_direct_cpu_ms_by_thread`` (and ``server_stream_...``) per level, where the
server's extra CPU per request goes.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from calexec import cliargs
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Status
from calexec.contracts.types import TaskKind
from calexec.drivers.device_spec import DeviceSpec, with_emulated_latency
from calexec.drivers.memory import pin_mmap_threshold
from calexec.drivers.serving.process import (
    MAX_SWITCH_INTERVAL_US,
    SERVING_SWITCH_INTERVAL_US,
    set_gil_switch_interval_us,
)
from calexec.drivers.tools.bench import threadcpu
from calexec.drivers.tools.bench.api_floor import EngineSocket
from calexec.drivers.tools.bench.core import cpu_model
from calexec.drivers.tools.bench.hostload import HostMeter, noise_line
from calexec.drivers.tools.bench.subproc import run_json_program
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

_WAIT_S = 60.0


class BenchError(RuntimeError):
    pass


def _direct_request(ex: DeviceExecutor, seq: int, prompt: list[int], max_tokens: int,
                    logits: np.ndarray | None = None) -> list[int]:
    """One request through the executor API: prefill, then greedy decodes, then release; the
    tokens. ``logits``: the caller's row for every job's logits (no allocation per token, as
    the executor's API recommends; None: one allocated per job)."""
    tokens: list[int] = []
    deadline = time.monotonic() + _WAIT_S
    ids = np.asarray(prompt, dtype=np.int32)
    request = InferenceRequest(seq_id=seq, kind=TaskKind.PREFILL_IDS, tokens=ids,
                               positions=np.arange(len(ids), dtype=np.int32), past_len=0,
                               deadline=deadline)
    for _ in range(max_tokens):
        result = ex.enqueue(request, logits).wait_until(deadline)
        if isinstance(result, Status):
            raise BenchError(f"executor job failed: {result}")
        tokens.append(result.argmax)
        request = InferenceRequest(seq_id=seq, kind=TaskKind.DECODE,
                                   tokens=np.asarray([result.argmax], dtype=np.int32),
                                   positions=np.asarray([result.kv_len], dtype=np.int32),
                                   past_len=result.kv_len, deadline=deadline)
    if ex.kvc is not None:  # (the executor is started: it has one)
        ex.kvc.reset_sequence(seq)
    return tokens


def load(requests: int, concurrency: int, one: Callable[[int, int], None],
         raw: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
    """``requests`` calls of ``one(worker, i)`` spread over ``concurrency`` threads, all of
    them done within ``timeout_s`` seconds (default: ``2 * _WAIT_S`` per request, what one
    direct request may wait for a sequence id and then for its tokens), else BenchError
    naming the threads still running (their figures would be an unfinished run's: the
    requests not done counted as done, the next side measured beside them);
    ``raw``: also ``elapsed_s`` and every latency (``latencies_ms``), as ``loadgen.run``."""
    latencies: list[float] = []
    lock = threading.Lock()
    todo = iter(range(requests))
    errors: list[BaseException] = []
    worker_cpu = [0.0]  # the workers' own CPU (s), told before they end (threadcpu.span)
    stop = threading.Event()  # the bound passed: no worker takes another request
    bound_s = cliargs.wait_s(2 * _WAIT_S * (requests + 1)) if timeout_s is None else timeout_s

    def worker(w: int) -> None:
        cpu0 = time.thread_time()
        try:
            while not stop.is_set():
                with lock:
                    i = None if errors else next(todo, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    one(w, i)
                except BaseException as exc:  # noqa: BLE001 - reported after the run
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    latencies.append(time.perf_counter() - t0)
        finally:
            with lock:
                worker_cpu[0] += time.thread_time() - cpu0

    t0 = time.perf_counter()
    # daemon threads: one left past the bound (reported below) never holds the process
    threads = [threading.Thread(target=worker, args=(w,), name=f"{LOAD_THREAD}-{w}",
                                daemon=True) for w in range(concurrency)]
    for t in threads:
        t.start()
    # one deadline for them all (each join had 4 * _WAIT_S of its own, and the figures of
    # a run still going were returned as if it had ended)
    until = time.monotonic() + bound_s
    for t in threads:
        t.join(max(0.0, until - time.monotonic()))
    left = [t.name for t in threads if t.is_alive()]
    if left:
        stop.set()
        raise BenchError(f"{len(left)} load thread(s) still running after {bound_s:g} s "
                         f"({', '.join(left)}); no figures from an unfinished run")
    elapsed = time.perf_counter() - t0
    if errors:
        raise BenchError(f"{len(errors)} request(s) failed, first: {errors[0]}")
    ms = np.asarray(latencies) * 1000.0
    out: dict[str, Any] = {"req_per_s": round(requests / elapsed, 2),
                           "p50_ms": round(float(np.percentile(ms, 50)), 3),
                           "p99_ms": round(float(np.percentile(ms, 99)), 3)}
    if raw:
        out["elapsed_s"] = elapsed
        out["latencies_ms"] = [round(float(v), 4) for v in ms]
        out["thread_cpu_s"] = {LOAD_THREAD: worker_cpu[0]}
    return out


def rate(blocks: Sequence[dict[str, Any]]) -> float:
    """Requests per second of raw blocks (``load`` / ``loadgen.run`` with ``raw``): their
    requests over their summed time (one block: that block's rate)."""
    return (sum(len(b["latencies_ms"]) for b in blocks)
            / sum(float(b["elapsed_s"]) for b in blocks))


def pooled(blocks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures from its blocks (raw ``load`` / ``loadgen.run`` results): requests/s
    over the blocks' summed time, P50/P99 over every latency, the time to the first token
    likewise when the blocks streamed."""
    latencies = np.concatenate([np.asarray(b["latencies_ms"], dtype=np.float64)
                                for b in blocks])
    out: dict[str, Any] = {"req_per_s": round(rate(blocks), 2),
                           "p50_ms": round(float(np.percentile(latencies, 50)), 3),
                           "p99_ms": round(float(np.percentile(latencies, 99)), 3)}
    if blocks and all("cpu_s" in b for b in blocks):
        served = sum(int(b["served"]) for b in blocks)
        out["cpu_ms_per_request"] = round(1000.0 * sum(float(b["cpu_s"]) for b in blocks)
                                          / served, 3)
        spans = [b["cpu_span"] for b in blocks if b.get("cpu_span") is not None]
        if served and len(spans) == len(blocks):
            out["cpu_ms_per_request_by_thread"] = threadcpu.per_request_ms(spans, served)
            out["threads_ended"] = sum(one.threads_ended for one in spans)
    if all("ttft_ms" in b for b in blocks):
        first = np.concatenate([np.asarray(b["ttft_ms"], dtype=np.float64) for b in blocks])
        out["ttft_p50_ms"] = round(float(np.percentile(first, 50)), 3)
        out["ttft_p99_ms"] = round(float(np.percentile(first, 99)), 3)
    return out


def with_cpu(side: Callable[[int], dict[str, Any]], untimed: int
             ) -> Callable[[int], dict[str, Any]]:
    """``side`` (a block of ``size`` timed requests, raw figures) that also records this
    process's CPU time over the block (``cpu_s``), per thread role (``cpu_span``, a
    ``threadcpu.SpanCpu``; None where threads cannot be read) and the requests it served
    (``served``: the timed ones and ``untimed`` warm-up requests the block sends first)."""
    def block(size: int) -> dict[str, Any]:
        threads0 = threadcpu.snapshot()
        cpu0 = time.process_time()
        got = side(size)
        cpu_s = time.process_time() - cpu0
        threads1 = threadcpu.snapshot()
        cpu_span = (None if threads0 is None or threads1 is None else
                    threadcpu.span(threads0, threads1, got.get("thread_cpu_s")))
        return {**got, "cpu_s": cpu_s, "served": size + untimed, "cpu_span": cpu_span}
    return block


def _with_config(service: Any, changes: dict[str, Any], side: Callable[[int], dict[str, Any]],
                 size: int) -> dict[str, Any]:
    """A block of ``side`` with ``service``'s ServerConfig changed by ``changes`` (restored
    after it)."""
    config = service.config
    service.config = attrs.evolve(config, **changes)
    try:
        return side(size)
    finally:
        service.config = config


def rounds_for(requests: int, concurrency: int, rounds: int) -> int:
    """How many interleaved rounds a level runs: ``rounds``, fewer when a round's block would
    hold fewer than ``MIN_BLOCK_PER_CLIENT`` requests per client (a short block at high
    concurrency is mostly ramp-up and tail), at least 1."""
    return max(1, min(rounds, requests // (MIN_BLOCK_PER_CLIENT * concurrency)))


def split(requests: int, parts: int) -> list[int]:
    """``requests`` in ``parts`` block sizes that differ by at most one."""
    base, extra = divmod(requests, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


#: the direct side's load threads' name (``bench-load-W``; their role in
#: ``cpu_ms_per_request_by_thread``)
LOAD_THREAD = "bench-load"
#: the concurrency levels by default (issue 28: c=1, 8 and 64)
DEFAULT_LEVELS = (1, 8, 64)
#: interleaved rounds per level by default: the compared sides (direct, server,
#: server_stream, api_process_floor) each run a block per round, their order rotated, so a drift of the host
#: during the run falls on every side alike
DEFAULT_ROUNDS = 4
#: a round's block holds at least this many requests per client (``rounds_for``)
MIN_BLOCK_PER_CLIENT = 4
#: timed requests per level and side by default: enough for a P99 that is not one sample
DEFAULT_REQUESTS = 400
#: untimed requests before each side's timed ones
WARMUP_REQUESTS = 8
#: the sequence ids the in-process side leases (the server's ``max_sequences`` default: more
#: concurrent requests wait for one, as they do at the server)
DIRECT_SEQS = 32
#: where the HTTP load generator runs: a process of its own (default), or threads of the
#: server's process (what the benchmark did before issue 28: it shares the server's GIL)
LOADGEN_PLACES = ("process", "thread")


def _http_load(url: str, requests: int, concurrency: int, max_tokens: int, stream: bool,
               loadgen: str, client: str = "stdlib", raw: bool = False) -> dict[str, Any]:
    """One side's figures from the load generator (``loadgen.py``, its HTTP client
    ``client``): in a process of its own, or in this process's threads."""
    from calexec.drivers.tools.bench import loadgen as lg

    if loadgen == "thread":
        try:
            return lg.run(url, requests, concurrency, max_tokens, stream, WARMUP_REQUESTS,
                          client, raw)
        except lg.LoadError as exc:
            raise BenchError(str(exc)) from None
    argv = [sys.executable, "-m", "calexec.drivers.tools.bench.loadgen", "--url", url,
            "--requests", str(requests), "--concurrency", str(concurrency), "--max-tokens",
            str(max_tokens), "--warmup", str(WARMUP_REQUESTS), "--client", client,
            *(["--stream"] if stream else []), *(["--raw"] if raw else [])]
    bound = cliargs.wait_s(_WAIT_S * (requests + WARMUP_REQUESTS + 2))
    result = run_json_program(argv, bound, "the load generator", BenchError)
    return result


class _DirectSeqs:
    """Sequence ids ``1..count`` of ``ex``, each with its own logits row: ``run`` leases one
    for a request straight through the executor (``_direct_request``) and gives it back, so
    more concurrent requests than ids wait for one (bounded)."""

    def __init__(self, ex: DeviceExecutor, count: int) -> None:
        self.ex = ex
        vocab = ex.generation.vocab_size if ex.generation is not None else 0
        self._seqs: queue.Queue[int] = queue.Queue()
        self._rows: dict[int, np.ndarray] = {}
        for seq in range(1, count + 1):
            self._seqs.put(seq)
            self._rows[seq] = np.empty(vocab, dtype=np.float32)

    def run(self, prompt: list[int], max_tokens: int) -> list[int]:
        seq = self._seqs.get(timeout=_WAIT_S)
        try:
            return _direct_request(self.ex, seq, prompt, max_tokens, self._rows[seq])
        finally:
            self._seqs.put(seq)


#: the bytes a Unix socket's path may take (sun_path: 108 on Linux with its NUL, 104 on macOS)
SUN_PATH_MAX = 104


class _ApiFloor:
    """The ``api_process_floor`` side's two halves (``api_floor.py``): the engine socket in
    this process, running each request straight through ``ex`` on sequence ids of its own
    pool, and the API process in front of it. ``url`` is None, with ``reason``, where the
    platform has no Unix sockets. Closes both (bounded) on exit."""

    START_S = 60.0

    def __init__(self, ex: DeviceExecutor, tmp: str, max_tokens: int) -> None:
        self.ex, self.tmp, self.max_tokens = ex, tmp, max_tokens
        self.url: str | None = None
        self.reason: str | None = None
        self._engine: EngineSocket | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._short: str | None = None  # the socket's own short directory, when one is made
        self.run = _DirectSeqs(ex, DIRECT_SEQS).run

    def __enter__(self) -> _ApiFloor:
        import socket

        if not hasattr(socket, "AF_UNIX"):
            self.reason = "no Unix sockets on this platform"
            return self
        path = f"{self.tmp}/engine.sock"
        try:
            if len(os.fsencode(path)) >= SUN_PATH_MAX:
                # a long $TMPDIR (a CI workspace's, macOS's /var/folders/...): a Unix socket's
                # path takes ~100 bytes, and the bind was `internal error: OSError: AF_UNIX
                # path too long`, exit 70
                self._short = tempfile.mkdtemp(prefix="calexec-sock-", dir="/tmp")
                path = f"{self._short}/engine.sock"
            self._engine = EngineSocket(path, self.run)
        except OSError as exc:  # (no /tmp to write in: the side is skipped, saying why)
            self.__exit__()
            self.reason = f"its engine socket {path!r} cannot be bound: {exc.strerror or exc}"
            return self
        try:
            # its own session: a Ctrl-C at the terminal reaches the bench alone, which ends
            # the API process by closing its stdin (one reaching it before its SIGINT was
            # ignored, while Python imported uvicorn, or after uvicorn restored it, was a
            # KeyboardInterrupt traceback of its own on the bench's terminal); one landing
            # inside Popen() is held until the process is recorded for __exit__ to end
            with cliargs.interrupts_held():
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "calexec.drivers.tools.bench.api_floor",
                     "--socket", path, "--max-seconds", str(_WAIT_S * 120)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    start_new_session=True)
            line = _first_line(self._proc, self.START_S)
            if not line.startswith("http://127.0.0.1:"):
                raise BenchError(f"the API process did not start: {line!r}")
            self.url = line
            # the same prompt through both paths: the side is only a floor if it answers alike
            prompt = [5, 7, 9]
            got = _post_tokens(self.url, prompt, self.max_tokens)
            want = self.run(prompt, self.max_tokens)
            if got != want:
                raise BenchError(f"the API process answered {got}, the executor {want}")
        except BaseException:
            self.__exit__()  # (a with statement does not call __exit__ when __enter__ raises)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()  # the API process exits at EOF
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._short is not None:
            shutil.rmtree(self._short, ignore_errors=True)
            self._short = None


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The first line ``proc`` prints on stdout within ``timeout`` s ("" when none)."""
    got: list[str] = []
    stdout = proc.stdout
    if stdout is None:
        return ""

    def read() -> None:
        got.append(stdout.readline())
    reader = threading.Thread(target=read, name="api-floor-start", daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0].strip() if got else ""


def _post_tokens(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One completion's token ids from ``url`` (the API process's answer)."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=_WAIT_S)
    try:
        conn.request("POST", "/v1/completions",
                     body=json.dumps({"prompt": prompt, "max_tokens": max_tokens}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise BenchError(f"the API process answered HTTP {response.status}: {body[:200]!r}")
    return [int(t) for t in json.loads(body)["choices"][0]["token_ids"]]


def http_floor_app() -> Any:
    """The HTTP stack alone (the ``http_floor`` side): a FastAPI app whose ``/v1/completions``
    parses the same kind of pydantic body and answers a canned completion of ``max_tokens``
    token ids at once, no executor behind it. What a request costs the load generator,
    uvicorn and FastAPI on this host: the ceiling of any server on that stack."""
    from fastapi import FastAPI

    from calexec.drivers.tools.bench.api_floor import floor_body, floor_completion

    Body = floor_body()
    app = FastAPI()

    async def completions(body: Any) -> dict[str, Any]:
        return floor_completion("http-floor", len(body.prompt), list(range(body.max_tokens)))
    # (annotations are strings here, and ``Body`` is local: FastAPI gets the class itself)
    completions.__annotations__["body"] = Body
    app.post("/v1/completions")(completions)
    return app


class HandoffFloor:
    """The ``handoff_floor`` side (stop 71): a FastAPI app whose ``/v1/completions`` parses
    the ``http_floor`` body, hands the request to a worker thread of a
    ``threads.WorkerPool`` (as the server hands a decode burst to ``calexec-burst``), which
    runs it straight through the executor as the direct side does (``seqs``: the level's
    ``_DirectSeqs``), and answers its tokens as ``http_floor`` does. HTTP, one hand-off to
    a thread and back, and the direct side's request: what a server on this stack that
    hands each request to a thread costs before anything it does beside (admission, the
    waiting queue, sampling, stop strings, detokenizing, metrics, resumes). ``app`` is
    served by the bench; ``close`` ends the pool's threads."""

    THREADS = "bench-handoff"

    def __init__(self) -> None:
        from fastapi import FastAPI

        from calexec.drivers.serving.threads import WorkerPool
        from calexec.drivers.tools.bench.api_floor import floor_body, floor_completion

        self.seqs: _DirectSeqs | None = None
        self._pool = WorkerPool(2 * DIRECT_SEQS, self.THREADS)
        body_model = floor_body()
        app = FastAPI()

        async def completions(body: Any) -> dict[str, Any]:
            seqs = self.seqs
            if seqs is None:
                raise BenchError("the handoff floor was asked before a level set its ids")
            tokens = await asyncio.wrap_future(self._pool.submit(
                seqs.run, list(body.prompt), body.max_tokens))
            return floor_completion("handoff-floor", len(body.prompt), tokens)
        completions.__annotations__["body"] = body_model
        app.post("/v1/completions")(completions)
        self.app = app

    def close(self) -> None:
        self._pool.shutdown()


#: the prompt length of every request of the bench (``[i % 1000 + 1, 7, 9]``: loadgen.py, the
#: direct side, the API process floor's check)
PROMPT_TOKENS = 3


def max_tokens_refusal(ex: DeviceExecutor, max_tokens: int) -> str | None:
    """Why the started ``ex``'s model cannot serve ``max_tokens`` tokens after the bench's
    prompt (None: it can): the prompt and them must fit its context (``max_seq``), else the
    server answers 400 ``context_length_exceeded`` and the direct side fails step 2."""
    context = None if ex.gen is None else ex.gen.contracts.submodels[TaskKind.DECODE].max_seq
    if context is None or PROMPT_TOKENS + max_tokens <= context:
        return None
    return (f"--max-tokens={max_tokens}: at most {context - PROMPT_TOKENS} (the model's context "
            f"max_seq={context} holds the bench's {PROMPT_TOKENS}-token prompt and them)")


def run_server_bench(requests: int, max_tokens: int, decode_us: int,
                     device: DeviceSpec = DeviceSpec(),
                     levels: Sequence[int] = DEFAULT_LEVELS, loadgen: str = "process",
                     stream: bool = True, client: str = "stdlib",
                     rounds: int = DEFAULT_ROUNDS, native_relay: bool = False
                     ) -> dict[str, Any]:
    """``native_relay``: the executor (both sides') runs its submitter on the native relay
    (``ExecutorConfig.native_relay``, ``serve --native-relay``). Per concurrency level:
    ``direct`` (the in-process executor, this process's threads), ``server`` (HTTP, not
    streaming), ``server_stream`` (HTTP, server-sent events; when
    ``stream``), ``server_no_ahead`` (HTTP with greedy ahead off), ``server_always_prearm``
    (HTTP pre-arming at any device speed), ``server_no_bursts`` (HTTP
    with the decode bursts off), ``server_thread_waits`` (HTTP with the bursts and the inline
    waits off) and ``http_floor`` (the HTTP stack alone:
    ``http_floor_app``), each ``requests`` timed requests after a short warm-up; the HTTP load
    generator runs where ``loadgen`` says, with the HTTP client ``client``
    (``loadgen.CLIENTS``). The compared sides (direct, server, server_stream) run
    interleaved: ``rounds`` rounds (``rounds_for``) of one block each, the order rotated per
    round; the ratios are over the pooled blocks, ``round_throughput_ratios`` per round."""
    if rounds < 1:
        raise BenchError(f"rounds={rounds}: must be >= 1")
    from calexec.drivers.serving.executor_view import served
    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.tools.bench.loadgen import CLIENTS
    from calexec.drivers.tools.chaos import LiveServer

    if loadgen not in LOADGEN_PLACES:
        raise BenchError(f"loadgen must be one of {LOADGEN_PLACES}, got {loadgen!r}")
    if client not in CLIENTS:
        raise BenchError(f"client must be one of {CLIENTS}, got {client!r}")
    with tempfile.TemporaryDirectory(prefix="calexec-bench-") as tmp:
        path = device.calbin(tmp)
        ex = DeviceExecutor(device.runtime(), device.manifest(), with_emulated_latency(
            ExecutorConfig(calbin_path=path, device_config=f"decode_us={decode_us}",
                           recovery=device.recovery(), native_relay=native_relay)))
        status = ex.start()
        if not status.ok:
            ex.shutdown()
            raise cliargs.UserError(f"executor start failed: {status}", cliargs.EXIT_REFUSED)
        refusal = max_tokens_refusal(ex, max_tokens)
        if refusal is not None:  # before any request: each side would fail at its first one
            ex.shutdown()
            raise cliargs.UserError(refusal)
        app = create_app(served(ex), ServerConfig())
        handoff: HandoffFloor | None = None
        try:
            handoff = HandoffFloor()
            with LiveServer(app, name="uvicorn-server") as live, \
                    LiveServer(http_floor_app(), name="uvicorn-http-floor") as floor, \
                    LiveServer(handoff.app, name="uvicorn-handoff-floor") as handoff_live, \
                    _ApiFloor(ex, tmp, max_tokens) as split:
                result = _levels(ex, app, live.url, floor.url, requests, max_tokens,
                                 decode_us, levels, loadgen, stream, client, rounds,
                                 split.url, (handoff, handoff_live.url))
                if split.url is None:
                    result["api_process_floor"] = f"not run: {split.reason}"
                result["native_relay"] = native_relay
                result["relay_submitted"] = ex.snapshot()["relay_submitted"]
                return result
        except TimeoutError as exc:  # (a server that did not start)
            raise BenchError(str(exc)) from None
        finally:
            if handoff is not None:
                handoff.close()
            ex.shutdown()


def _levels(ex: DeviceExecutor, app: Any, url: str, floor_url: str, requests: int,
            max_tokens: int, decode_us: int, levels: Sequence[int], loadgen: str,
            stream: bool, client: str, rounds: int,
            split_url: str | None = None,
            handoff: tuple[HandoffFloor, str] | None = None) -> dict[str, Any]:
    """Every level's sides (``run_server_bench``); ``handoff``: the ``handoff_floor``
    side's app and its URL."""
    result: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens,
                              "decode_us": decode_us, "levels": list(levels),
                              "loadgen": loadgen, "loadgen_client": client, "stream": stream,
                              "warmup_requests": WARMUP_REQUESTS, "rounds": rounds,
                              "process_cpu_scope": ("this process: the server and the executor"
                                            if loadgen == "process" else
                                            "this process: the server, the executor and "
                                            "the load generator's threads")}
    for concurrency in levels:
        seqs = _DirectSeqs(ex, min(concurrency, DIRECT_SEQS))

        def direct(w: int, i: int, seqs: _DirectSeqs = seqs) -> None:
            seqs.run([i % 1000 + 1, 7, 9], max_tokens)

        def http(streaming: bool, count: int = requests, concurrency: int = concurrency,
                 target: str = url, raw: bool = False) -> dict[str, Any]:
            return _http_load(target, count, concurrency, max_tokens, streaming,
                              loadgen, client, raw)

        print(f"bench server: concurrency {concurrency}", file=sys.stderr)
        load(min(requests, WARMUP_REQUESTS), concurrency, direct)  # warm-up
        sides: dict[str, Callable[[int], dict[str, Any]]] = {
            "direct": with_cpu(functools.partial(load, concurrency=concurrency,
                                                one=direct, raw=True), 0),
            "server": with_cpu(functools.partial(http, False, raw=True), WARMUP_REQUESTS)}
        if stream:
            sides["server_stream"] = with_cpu(functools.partial(http, True, raw=True),
                                              WARMUP_REQUESTS)
            sides["server_stream_no_bursts"] = with_cpu(
                functools.partial(_with_config, app.state.service,
                                  {"stream_bursts": False},
                                  functools.partial(http, True, raw=True)), WARMUP_REQUESTS)
        if split_url is not None:
            sides["api_process_floor"] = functools.partial(http, False, target=split_url,
                                                           raw=True)
        if handoff is not None:
            handoff[0].seqs = seqs
            sides["handoff_floor"] = with_cpu(functools.partial(
                http, False, target=handoff[1], raw=True), WARMUP_REQUESTS)
        level_rounds = rounds_for(requests, concurrency, rounds)
        blocks: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        names = list(sides)
        for r, size in enumerate(split(requests, level_rounds)):
            for name in names[r % len(names):] + names[:r % len(names)]:
                blocks[name].append(sides[name](size))
        level: dict[str, Any] = {name: pooled(got) for name, got in blocks.items()}
        d, h = level["direct"], level["server"]
        level["rounds"] = level_rounds
        level["round_throughput_ratios"] = [
            round(rate([s]) / rate([x]), 3)
            for s, x in zip(blocks["server"], blocks["direct"], strict=True)]
        service = app.state.service
        plain = functools.partial(http, False)
        n = _with_config(service, {"greedy_ahead": False}, plain, requests)
        a = _with_config(service, {"prearm_min_device_ms": 0.0}, plain, requests)
        b = _with_config(service, {"decode_bursts": False}, plain, requests)
        t = _with_config(service, {"decode_bursts": False, "inline_waits": False}, plain,
                         requests)
        f = http(False, target=floor_url)
        level.update({
            "server_no_ahead": n,
            "ahead_p50_ratio": round(h["p50_ms"] / n["p50_ms"], 3),
            "server_always_prearm": a,
            "prearm_policy_throughput_ratio": round(h["req_per_s"] / a["req_per_s"], 3),
            "server_no_bursts": b,
            "burst_throughput_ratio": round(h["req_per_s"] / b["req_per_s"], 3),
            "server_thread_waits": t,
            "inline_throughput_ratio": round(b["req_per_s"] / t["req_per_s"], 3),
            "http_floor": f,
            # what a server costing nothing but its HTTP stack would reach at c=1, where a
            # request takes the executor's time plus the stack's: f / (f + d)
            "http_floor_ratio_bound": round(f["req_per_s"] / (f["req_per_s"]
                                                             + d["req_per_s"]), 3),
            "throughput_ratio": round(h["req_per_s"] / d["req_per_s"], 3),
            "p50_ratio": round(h["p50_ms"] / d["p50_ms"], 3),
            "p99_ratio": round(h["p99_ms"] / d["p99_ms"], 3),
            "cpu_per_request_ratio": round(h["cpu_ms_per_request"]
                                           / d["cpu_ms_per_request"], 3)})
        if stream:
            level["stream_throughput_ratio"] = round(
                level["server_stream"]["req_per_s"] / d["req_per_s"], 3)
            level["stream_cpu_per_request_ratio"] = round(
                level["server_stream"]["cpu_ms_per_request"] / d["cpu_ms_per_request"], 3)
            unburst = level["server_stream_no_bursts"]
            level["stream_burst_throughput_ratio"] = round(
                level["server_stream"]["req_per_s"] / unburst["req_per_s"], 3)
            level["stream_burst_cpu_ratio"] = round(
                level["server_stream"]["cpu_ms_per_request"] / unburst["cpu_ms_per_request"], 3)
        for name in ("server", "server_stream"):  # where the server's extra CPU goes
            by_thread = level.get(name, {}).get("cpu_ms_per_request_by_thread")
            if by_thread is not None and "cpu_ms_per_request_by_thread" in d:
                level[f"{name}_minus_direct_cpu_ms_by_thread"] = threadcpu.difference(
                    by_thread, d["cpu_ms_per_request_by_thread"])
        if handoff is not None:
            floor = level["handoff_floor"]
            level["handoff_floor_ratio"] = round(floor["req_per_s"] / d["req_per_s"], 3)
            level["handoff_floor_cpu_ratio"] = round(floor["cpu_ms_per_request"]
                                                     / d["cpu_ms_per_request"], 3)
        if split_url is not None:
            level["api_process_floor_ratio"] = round(
                level["api_process_floor"]["req_per_s"] / d["req_per_s"], 3)
        result[f"c{concurrency}"] = level
    return result


def concurrency_levels(text: str) -> list[int]:
    """``--concurrency`` as a comma list of levels (argparse type: one line naming the value)."""
    out: list[int] = []
    for item in text.split(","):
        given = cliargs.ascii_integer(item)  # (int() also reads "1_0" and "٣")
        if given is None:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not an integer")
        level = given
        if not 1 <= level <= 256:
            raise argparse.ArgumentTypeError(f"{level} is not in 1..256")
        if level not in out:
            out.append(level)
    return out


@cliargs.command_main
def main(argv: list[str]) -> int:
    from calexec.drivers.tools.bench.loadgen import CLIENTS

    parser = cliargs.parser("calexec bench server", __doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=cliargs.count("bench server --requests"),
                        default=DEFAULT_REQUESTS,
                        help="timed requests per level and side (default "
                             f"{DEFAULT_REQUESTS}: a P99 of more than a few samples; at most "
                             f"{cliargs.MAX_COUNTS['bench server --requests']})")
    parser.add_argument("--concurrency", type=concurrency_levels,
                        default=list(DEFAULT_LEVELS), metavar="C[,C...]",
                        help="concurrency levels (default "
                             f"{','.join(map(str, DEFAULT_LEVELS))})")
    parser.add_argument("--loadgen", choices=LOADGEN_PLACES, default="process",
                        help="where the HTTP load generator runs: a process of its own "
                             "(default) or threads of the server's process")
    parser.add_argument("--client", choices=CLIENTS, default=CLIENTS[0],
                        help="the load generator's HTTP client: the standard library's "
                             "http.client (default; light, so latency is the server's) or "
                             "httpx (the client of the figures before 2026-12-02)")
    parser.add_argument("--no-stream", action="store_true",
                        help="skip the streaming (server-sent events) side")
    parser.add_argument("--max-tokens", type=cliargs.positive_int, default=8,
                        help="tokens per request")
    parser.add_argument("--decode-us", type=cliargs.latency_us, default=10000,
                        help="emulated decode latency in us (0 = zero latency)")
    parser.add_argument("--rounds", type=cliargs.count("bench server --rounds"),
                        default=DEFAULT_ROUNDS,
                        help="interleaved rounds of the direct, server and server_stream "
                             "sides per level, fewer when a block would be short "
                             f"(default {DEFAULT_ROUNDS}, at most "
                             f"{cliargs.MAX_COUNTS['bench server --rounds']})")
    parser.add_argument("--gil-switch-us", type=cliargs.int_in(0, MAX_SWITCH_INTERVAL_US),
                        default=SERVING_SWITCH_INTERVAL_US,
                        help="GIL switch interval for the run (us; 0 keeps Python's 5000; "
                             "default: what calexec serve uses)")
    parser.add_argument("--native-relay", action="store_true",
                        help="the executor's submitter on its native relay "
                             "(ExecutorConfig.native_relay, serve --native-relay)")
    cliargs.add_device_args(parser)
    args = parser.parse_args(argv[2:])
    if args.decode_us < 0:
        parser.error(f"--decode-us={args.decode_us}: must be >= 0")
    device = cliargs.device_spec(args)
    cliargs.check_calbin(device)
    # the process policy calexec serve applies at start (both sides run under it): the
    # server is measured as it is deployed
    pinned = pin_mmap_threshold()
    previous = set_gil_switch_interval_us(args.gil_switch_us)
    # the load generator's and the API floor's processes are this run's own (its process
    # tree), not the "others": other work on the host makes the span noisy either way
    host = HostMeter().start()
    try:
        result = run_server_bench(args.requests, args.max_tokens, args.decode_us, device,
                                  args.concurrency, args.loadgen, not args.no_stream,
                                  args.client, args.rounds, args.native_relay)
    except BenchError as exc:  # (a DeviceSpecError: exit 2, by cliargs.command_main)
        print(f"calexec bench server: {exc}", file=sys.stderr)
        return 1
    finally:
        set_gil_switch_interval_us(previous)
    result["gil_switch_interval_us"] = args.gil_switch_us or previous
    result["mmap_threshold_pinned"] = pinned
    result["host"] = host.report()
    noisy = noise_line(result["host"])
    if noisy is not None:
        print(f"bench server: {noisy}", file=sys.stderr)
    result["cpu_model"] = cpu_model()
    result["cpus"] = os.cpu_count()
    result["python"] = platform.python_version()
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
