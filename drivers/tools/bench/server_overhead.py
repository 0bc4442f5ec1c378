"""``calexec bench server [--json] [--requests N] [--max-tokens M] [--decode-us US]``.

The reference server's own overhead (issue 6's figures): the same bounded request load, a short
prompt then ``max_tokens`` greedy tokens per request, sent (a) over loopback HTTP to the server
(uvicorn on 127.0.0.1, an ephemeral port, httpx clients) and (b) straight into the in-process
executor the server embeds, at concurrency 1 and 8, on the same emulated device profile, in one
run. Reports requests/s and request latency P50/P99 for both and their ratios. A third side,
``server_no_ahead``, is the same server with ``ServerConfig.greedy_ahead`` off (each decode step
fired by the request's own loop instead of by the executor's completion thread), so the run
shows what greedy ahead buys over HTTP (``ahead_p50_ratio``: server / server_no_ahead). Numbers
are reported, never asserted.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from calexec import cliargs
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Status
from calexec.contracts.types import TaskKind
from calexec.drivers.device_spec import DeviceSpec, DeviceSpecError
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

_WAIT_S = 60.0


class BenchError(RuntimeError):
    pass


def _direct_request(ex: DeviceExecutor, seq: int, prompt: list[int], max_tokens: int) -> None:
    """One request through the executor API: prefill, then greedy decodes, then release."""
    deadline = time.monotonic() + _WAIT_S
    ids = np.asarray(prompt, dtype=np.int32)
    request = InferenceRequest(seq_id=seq, kind=TaskKind.PREFILL_IDS, tokens=ids,
                               positions=np.arange(len(ids), dtype=np.int32), past_len=0,
                               deadline=deadline)
    for _ in range(max_tokens):
        result = ex.enqueue(request).wait_until(deadline)
        if isinstance(result, Status):
            raise BenchError(f"executor job failed: {result}")
        request = InferenceRequest(seq_id=seq, kind=TaskKind.DECODE,
                                   tokens=np.asarray([result.argmax], dtype=np.int32),
                                   positions=np.asarray([result.kv_len], dtype=np.int32),
                                   past_len=result.kv_len, deadline=deadline)
    if ex.kvc is not None:  # (the executor is started: it has one)
        ex.kvc.reset_sequence(seq)


def _load(requests: int, concurrency: int, one: Callable[[int, int], None]) -> dict[str, float]:
    """``requests`` calls of ``one(worker, i)`` spread over ``concurrency`` threads (bounded)."""
    latencies: list[float] = []
    lock = threading.Lock()
    todo = iter(range(requests))
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            t0 = time.perf_counter()
            try:
                one(w, i)
            except BaseException as exc:  # noqa: BLE001 - reported after the run
                errors.append(exc)
                return
            with lock:
                latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(_WAIT_S * 4)
    elapsed = time.perf_counter() - t0
    if errors:
        raise BenchError(f"{len(errors)} request(s) failed, first: {errors[0]}")
    ms = np.asarray(latencies) * 1000.0
    return {"req_per_s": round(requests / elapsed, 2), "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3)}


def run_server_bench(requests: int, max_tokens: int, decode_us: int,
                     device: DeviceSpec = DeviceSpec()) -> dict[str, Any]:
    import httpx
    import uvicorn

    from calexec.drivers.serving.executor_view import served
    from calexec.drivers.serving.server import ServerConfig, create_app

    with tempfile.TemporaryDirectory(prefix="calexec-bench-") as tmp:
        path = device.calbin(tmp)
        ex = DeviceExecutor(device.runtime(), device.manifest(),
                            ExecutorConfig(calbin_path=path, device_config=f"decode_us={decode_us}",
                                           recovery=device.recovery()))
        status = ex.start()
        if not status.ok:
            raise BenchError(f"executor start failed: {status}")
        app = create_app(served(ex), ServerConfig())
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1",
                                               port=0, log_level="warning", access_log=False))
        thread = threading.Thread(target=server.run, name="bench-uvicorn", daemon=True)
        thread.start()
        end = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > end or not thread.is_alive():
                raise BenchError("uvicorn did not start")
            time.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        clients = [httpx.Client(base_url=url, timeout=_WAIT_S) for _ in range(8)]
        try:
            def via_http(w: int, i: int) -> None:
                r = clients[w].post("/v1/completions", json={"prompt": [i % 1000 + 1, 7, 9],
                                                             "max_tokens": max_tokens})
                if r.status_code != 200:
                    raise BenchError(f"HTTP {r.status_code}: {r.text[:200]}")

            def direct(w: int, i: int) -> None:
                _direct_request(ex, 40 + w, [i % 1000 + 1, 7, 9], max_tokens)

            result: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens,
                                      "decode_us": decode_us}
            for concurrency in (1, 8):
                print(f"bench server: concurrency {concurrency}", file=sys.stderr)
                _load(min(requests, 8), concurrency, via_http)  # warm-up
                d = _load(requests, concurrency, direct)
                h = _load(requests, concurrency, via_http)
                service = app.state.service
                config, service.config = service.config, attrs.evolve(service.config,
                                                                      greedy_ahead=False)
                try:
                    n = _load(requests, concurrency, via_http)
                finally:
                    service.config = config
                result[f"c{concurrency}"] = {
                    "direct": d, "server": h, "server_no_ahead": n,
                    "ahead_p50_ratio": round(h["p50_ms"] / n["p50_ms"], 3),
                    "throughput_ratio": round(h["req_per_s"] / d["req_per_s"], 3),
                    "p50_ratio": round(h["p50_ms"] / d["p50_ms"], 3),
                    "p99_ratio": round(h["p99_ms"] / d["p99_ms"], 3)}
        finally:
            for c in clients:
                c.close()
            server.should_exit = True
            thread.join(10)
            ex.shutdown()
    return result


@cliargs.command_main
def main(argv: list[str]) -> int:
    parser = cliargs.parser("calexec bench server", __doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=cliargs.positive_int, default=40,
                        help="requests per phase")
    parser.add_argument("--max-tokens", type=cliargs.positive_int, default=8,
                        help="tokens per request")
    parser.add_argument("--decode-us", type=int, default=10000,
                        help="emulated decode latency in us (0 = zero latency)")
    cliargs.add_device_args(parser)
    args = parser.parse_args(argv[2:])
    if args.decode_us < 0:
        parser.error(f"--decode-us={args.decode_us}: must be >= 0")
    device = cliargs.device_spec(args)
    try:
        result = run_server_bench(args.requests, args.max_tokens, args.decode_us, device)
    except (BenchError, DeviceSpecError) as exc:
        print(f"calexec bench server: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
