"""The load generator of ``calexec bench server`` (issue 28), meant to run in a process of its
own so that its client work does not share the server's GIL:

    python -m calexec.drivers.tools.bench.loadgen --url http://127.0.0.1:PORT \\
        --requests N --concurrency C --max-tokens M [--stream] [--warmup W]

Sends ``W`` untimed then ``N`` timed completions (prompt ``[i % 1000 + 1, 7, 9]``, greedy,
``max_tokens`` M; ``--stream``: server-sent events, read to ``data: [DONE]``) from ``C`` client
threads, each with its own httpx client, to a loopback URL only, and prints one JSON object:
requests/s, request latency P50/P99 (ms) and, streaming, the time to the first token chunk.
Exit 0; 1 when a request failed (the first failure on stderr); 2 on a bad argument. Every
request has a timeout and the run a bound, so it stops by itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np

_TIMEOUT_S = 60.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LoadError(RuntimeError):
    """A request failed (status, body or transport); the message says which."""


def _one(client: Any, i: int, max_tokens: int, stream: bool) -> float | None:
    """One completion; returns the time to the first token chunk (s) when streaming."""
    body = {"prompt": [i % 1000 + 1, 7, 9], "max_tokens": max_tokens}
    if not stream:
        r = client.post("/v1/completions", json=body)
        if r.status_code != 200:
            raise LoadError(f"HTTP {r.status_code}: {r.text[:200]}")
        return None
    t0 = time.perf_counter()
    first: float | None = None
    done = False
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise LoadError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            if first is None:
                first = time.perf_counter() - t0
    if not done:
        raise LoadError("the stream ended without data: [DONE]")
    return first


def run(url: str, requests: int, concurrency: int, max_tokens: int, stream: bool = False,
        warmup: int = 0) -> dict[str, Any]:
    """``warmup`` untimed then ``requests`` timed completions against ``url`` (loopback only)
    from ``concurrency`` threads; the figures (LoadError when a request failed)."""
    import httpx

    host = urlsplit(url).hostname
    if host not in _LOOPBACK:
        raise LoadError(f"--url={url}: the load generator only targets loopback addresses")
    workers = max(1, min(concurrency, max(requests, warmup)))
    clients = [httpx.Client(base_url=url, timeout=_TIMEOUT_S) for _ in range(workers)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def phase(count: int, latencies: list[float], ttft: list[float]) -> float:
        todo = iter(range(count))

        def worker(w: int) -> None:
            while not errors:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    first = _one(clients[w], i, max_tokens, stream)
                except BaseException as exc:  # noqa: BLE001 - reported after the run
                    with lock:
                        errors.append(exc)
                    return
                elapsed = time.perf_counter() - t0
                with lock:
                    latencies.append(elapsed)
                    if first is not None:
                        ttft.append(first)

        threads = [threading.Thread(target=worker, args=(w,), name=f"loadgen-{w}", daemon=True)
                   for w in range(min(workers, max(count, 1)))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        bound = time.monotonic() + _TIMEOUT_S * (count + 1)
        for t in threads:
            t.join(max(0.0, bound - time.monotonic()))
        if any(t.is_alive() for t in threads):
            errors.append(LoadError("a client thread did not finish in time"))
        return time.perf_counter() - t0

    try:
        if warmup:
            phase(warmup, [], [])
        latencies: list[float] = []
        ttft: list[float] = []
        elapsed = phase(requests, latencies, ttft) if not errors else 0.0
    finally:
        for c in clients:
            c.close()
    if errors:
        raise LoadError(f"{len(errors)} request(s) failed, first: {errors[0]}")
    ms = np.asarray(latencies) * 1000.0
    out: dict[str, Any] = {
        "req_per_s": round(requests / elapsed, 2),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3)}
    if stream:
        first_ms = np.asarray(ttft) * 1000.0
        out["ttft_p50_ms"] = round(float(np.percentile(first_ms, 50)), 3)
        out["ttft_p99_ms"] = round(float(np.percentile(first_ms, 99)), 3)
    return out


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="calexec-bench-loadgen", description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--requests", type=_positive, required=True)
    parser.add_argument("--concurrency", type=_positive, required=True)
    parser.add_argument("--max-tokens", type=_positive, required=True)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--warmup", type=int, default=0)
    args = parser.parse_args(argv)
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup}: must be >= 0")
    try:
        result = run(args.url, args.requests, args.concurrency, args.max_tokens, args.stream,
                     args.warmup)
    except LoadError as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover - run as a process by bench server
    sys.exit(main(sys.argv[1:]))
