"""The load generator of ``calexec bench server`` (issue 28), meant to run in a process of its
own so that its client work does not share the server's GIL:

    python -m calexec.drivers.tools.bench.loadgen --url http://127.0.0.1:PORT \\
        --requests N --concurrency C --max-tokens M [--stream] [--warmup W] \\
        [--client stdlib|httpx] [--raw]

Sends ``W`` untimed then ``N`` timed completions (prompt ``[i % 1000 + 1, 7, 9]``, greedy,
``max_tokens`` M; ``--stream``: server-sent events, read to ``data: [DONE]``) from ``C`` client
threads, each with its own keep-alive connection, to a loopback URL only, and prints one JSON
object: requests/s, request latency P50/P99 (ms) and, streaming, the time to the first token
chunk (``--raw``: also the timed phase's elapsed time and every latency, for pooling several
runs). Every answer is checked: status 200 and a JSON body with ``choices`` (streamed: every
``data:`` line JSON, ended by ``data: [DONE]``).

The client (``--client``): ``stdlib`` (default), Python's ``http.client``, one
``HTTPConnection`` per thread: what a load generator should be, light, so that the latency it
reports is the server's and not its own (about 0.25 ms of client CPU per request here);
``httpx``: the client the benchmark used before (about 1.1 ms of client CPU per request on the
same host, measured against the HTTP floor app), kept to compare with earlier figures.
Exit 0; 1 when a request failed (the first failure on stderr); 2 on a bad argument. Every
request has a timeout and the run a bound, so it stops by itself.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol
from urllib.parse import SplitResult, urlsplit

import numpy as np

from calexec.cliargs import non_negative_int, positive_int, wait_s

_TIMEOUT_S = 60.0
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LoadError(RuntimeError):
    """A request failed (status, body or transport); the message says which."""


#: the load generator's HTTP clients (``--client``); the first is the default
CLIENTS = ("stdlib", "httpx")
_PATH = "/v1/completions"


class _Client(Protocol):
    def post(self, body: dict[str, Any]) -> None: ...
    def stream(self, body: dict[str, Any]) -> float | None: ...
    def close(self) -> None: ...


def _check_body(status: int, raw: bytes) -> None:
    if status != 200:
        raise LoadError(f"HTTP {status}: {raw[:200]!r}")
    try:
        ok = "choices" in json.loads(raw)
    except ValueError:
        ok = False
    if not ok:
        raise LoadError(f"HTTP 200 without a JSON body with choices: {raw[:200]!r}")


def _read_events(lines: Iterable[bytes], t0: float) -> float | None:
    """Reads an SSE stream's lines up to ``data: [DONE]``, each ``data:`` line checked as
    JSON; returns the time from ``t0`` to the first event (None: no event before [DONE])."""
    first: float | None = None
    for raw in lines:
        if not raw.startswith(b"data: "):
            continue
        line = raw.rstrip(b"\r\n")
        if line == b"data: [DONE]":
            return first
        try:
            json.loads(line[6:])
        except ValueError:
            raise LoadError(f"a data line that is not JSON: {line[:200]!r}") from None
        if first is None:
            first = time.perf_counter() - t0
    raise LoadError("the stream ended without data: [DONE]")


class _Stdlib:
    """``http.client``: one keep-alive connection, opened again when the server closed it."""

    def __init__(self, url: SplitResult) -> None:
        self.host, self.port = url.hostname or "", url.port or 80
        self.path = url.path.rstrip("/") + _PATH
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=_TIMEOUT_S)
        self.used = False  # (a request answered on this connection: the server may close it)

    def _send(self, body: dict[str, Any]) -> http.client.HTTPResponse:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        try:
            self.conn.request("POST", self.path, body=data, headers=headers)
            response = self.conn.getresponse()
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            if not self.used:
                raise
            # a kept-alive connection the server closed between two requests: nothing of
            # this request was answered, so it is sent again once, on a new connection
            self.conn.close()
            self.conn.request("POST", self.path, body=data, headers=headers)
            response = self.conn.getresponse()
        self.used = True
        return response

    def post(self, body: dict[str, Any]) -> None:
        response = self._send(body)
        _check_body(response.status, response.read())

    def stream(self, body: dict[str, Any]) -> float | None:
        t0 = time.perf_counter()
        response = self._send({**body, "stream": True})
        if response.status != 200:
            raise LoadError(f"HTTP {response.status}: {response.read()[:200]!r}")
        first = _read_events(iter(response.readline, b""), t0)
        response.read()  # (the chunked body's end: the connection is reusable)
        return first

    def close(self) -> None:
        self.conn.close()


class _Httpx:
    """``httpx.Client`` (the benchmark's client before the stdlib one)."""

    def __init__(self, url: SplitResult) -> None:
        import httpx

        self.client = httpx.Client(base_url=url.geturl(), timeout=_TIMEOUT_S)

    def post(self, body: dict[str, Any]) -> None:
        r = self.client.post(_PATH, json=body)
        _check_body(r.status_code, r.content)

    def stream(self, body: dict[str, Any]) -> float | None:
        t0 = time.perf_counter()
        with self.client.stream("POST", _PATH, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                raise LoadError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
            return _read_events((text.encode() for text in r.iter_lines()), t0)

    def close(self) -> None:
        self.client.close()


def _one(client: _Client, i: int, max_tokens: int, stream: bool) -> float | None:
    """One completion; returns the time to the first token chunk (s) when streaming."""
    body = {"prompt": [i % 1000 + 1, 7, 9], "max_tokens": max_tokens}
    if not stream:
        client.post(body)
        return None
    return client.stream(body)


def run(url: str, requests: int, concurrency: int, max_tokens: int, stream: bool = False,
        warmup: int = 0, client: str = CLIENTS[0], raw: bool = False) -> dict[str, Any]:
    """``warmup`` untimed then ``requests`` timed completions against ``url`` (loopback only)
    from ``concurrency`` threads, each with a ``client`` (``CLIENTS``) of its own; the figures
    (LoadError when a request failed). ``raw``: also the timed phase's ``elapsed_s`` and every
    request's latency (``latencies_ms``; ``ttft_ms`` when streaming), so that several runs
    can be pooled (``bench server``'s interleaved rounds)."""
    if client not in CLIENTS:
        raise LoadError(f"client must be one of {CLIENTS}, got {client!r}")
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in _LOOPBACK:
        raise LoadError(f"--url={url}: the load generator only targets loopback http:// "
                        "addresses")
    try:
        _ = parts.port  # (raises on a port that is not a number in range)
    except ValueError as exc:
        raise LoadError(f"--url={url}: {exc}") from None
    workers = max(1, min(concurrency, max(requests, warmup)))
    make = _Stdlib if client == "stdlib" else _Httpx
    clients: list[_Client] = [make(parts) for _ in range(workers)]
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
        bound = time.monotonic() + wait_s(_TIMEOUT_S * (count + 1))
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
    if raw:
        out["elapsed_s"] = elapsed
        out["latencies_ms"] = [round(float(v), 4) for v in ms]
        if stream:
            out["ttft_ms"] = [round(float(v), 4) for v in first_ms]
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="calexec-bench-loadgen", description=__doc__)
    parser.add_argument("--url", required=True)
    # (calexec's ASCII integers: int() also read "1_0" as 10 and "٣" as 3 until stop 74)
    parser.add_argument("--requests", type=positive_int, required=True)
    parser.add_argument("--concurrency", type=positive_int, required=True)
    parser.add_argument("--max-tokens", type=positive_int, required=True)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--warmup", type=non_negative_int, default=0)
    parser.add_argument("--client", choices=CLIENTS, default=CLIENTS[0])
    parser.add_argument("--raw", action="store_true",
                        help="also print the elapsed time and every request's latency")
    args = parser.parse_args(argv)
    try:
        result = run(args.url, args.requests, args.concurrency, args.max_tokens, args.stream,
                     args.warmup, args.client, args.raw)
    except LoadError as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover - run as a process by bench server
    sys.exit(main(sys.argv[1:]))
