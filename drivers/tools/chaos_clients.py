"""The clients of the threaded fault soak (``calexec.drivers.tools.chaos``): each sends plain
and streaming completions, early disconnects and short timeouts in a seeded order, and keeps a
:class:`Record` of every request and what came back."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from typing import Any, cast

import httpx

from calexec import cliargs


class Record:
    """One client request and what came back."""

    __slots__ = ("kind", "prompt", "max_tokens", "timeout", "start", "end", "code", "body",
                 "events", "error")

    def __init__(self, kind, prompt, max_tokens, timeout) -> None:
        self.kind, self.prompt, self.max_tokens, self.timeout = kind, prompt, max_tokens, timeout
        self.start = self.end = 0.0
        self.code: int | None = None
        self.body: Any = None  # the JSON body (None: none, or streamed)
        self.events: list[str] = []
        self.error: str | None = None


def _client(url: str, index: int, seed: int, stop: threading.Event, out: list) -> None:
    rng = random.Random(seed * 1000 + index)
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            kind = rng.choice(["plain", "plain", "stream", "stream", "disconnect", "short"])
            prompt = [rng.randrange(1, 150000) for _ in range(rng.randint(1, 16))]
            max_tokens = rng.randint(1, 10)
            timeout = rng.uniform(0.02, 0.25) if kind == "short" else rng.uniform(1.0, 4.0)
            rec = Record(kind, prompt, max_tokens, timeout)
            body = {"prompt": prompt, "max_tokens": max_tokens, "timeout": timeout,
                    "stream": kind in ("stream", "disconnect")}
            rec.start = time.monotonic()
            try:
                if not body["stream"]:
                    r = http.post("/v1/completions", json=body)
                    rec.code, rec.body = r.status_code, r.json()
                else:
                    with http.stream("POST", "/v1/completions", json=body) as r:
                        rec.code = r.status_code
                        if r.status_code != 200:
                            rec.body = json.loads(r.read())
                        else:
                            keep = rng.randint(1, 3) if kind == "disconnect" else None
                            for line in r.iter_lines():
                                if line:
                                    rec.events.append(line)
                                if keep is not None and len(rec.events) >= keep:
                                    break  # leaving the block closes the connection
            except Exception as err:  # noqa: BLE001 - recorded, asserted on by the test
                rec.error = repr(err)
            rec.end = time.monotonic()
            out.append(rec)
            if rec.code in (429, 503):  # Retry-After: back off a little (shorter, to keep
                stop.wait(rng.uniform(0.05, 0.25))  # the pressure on, but never a spin)


def record_of(fields: dict[str, Any]) -> Record:
    """The :class:`Record` a client process printed (``as_fields``)."""
    rec = Record(fields["kind"], fields["prompt"], fields["max_tokens"], fields["timeout"])
    for name in ("start", "end", "code", "body", "events", "error"):
        setattr(rec, name, fields[name])
    return rec


def as_fields(rec: Record) -> dict[str, Any]:
    return {name: getattr(rec, name) for name in Record.__slots__}


def main(argv: list[str] | None = None) -> int:
    """``python -m calexec.drivers.tools.chaos_clients URL CLIENTS SEED MAX_SECONDS``: the
    soak's clients in a process of their own (``run_chaos`` starts it), so that their work does
    not share the server's GIL: a loaded host's scheduling of 16 client threads in the server's
    process put the server's own answer (its dump record) past a deadline it kept. Prints
    ``started`` once the clients run, sends until its standard input ends (the soak's end) or
    ``MAX_SECONDS`` passed, then one JSON line per request (``as_fields``, in the order they
    ended) and a last line ``{"alive": N, "crashed": [...]}``: clients still running after
    their bound, and what ended a client before the soak did (its requests stopped there)."""
    args = list(argv if argv is not None else sys.argv[1:])
    if len(args) != 4:
        print(f"chaos_clients: usage: URL CLIENTS SEED MAX_SECONDS (got {len(args)} "
              "arguments)", file=sys.stderr)
        return 2
    url = args[0]
    if not url.startswith(("http://127.0.0.1:", "http://localhost:")):
        print(f"chaos_clients: url={url!r}: loopback only", file=sys.stderr)
        return 2
    # the CLI's ASCII reading (cliargs): ``1_0`` and ``٣`` are no numbers here either (until
    # stop 75 Python's int()/float() read them as 10 and 3; a bad one was a traceback)
    clients, seed = cliargs.ascii_integer(args[1]), cliargs.ascii_integer(args[2])
    max_seconds = cliargs.ascii_number(args[3])
    for name, given, good in (
            ("CLIENTS", args[1], clients is not None and clients >= 1),
            ("SEED", args[2], seed is not None),
            ("MAX_SECONDS", args[3],
             max_seconds is not None and 0 < max_seconds < float("inf"))):
        if not good:
            need = {"CLIENTS": "an integer >= 1", "SEED": "an integer",
                    "MAX_SECONDS": "a number of seconds > 0"}[name]
            print(f"chaos_clients: {name}={given!r}: must be {need} in ASCII digits",
                  file=sys.stderr)
            return 2
    stop = threading.Event()
    out: list[Record] = []
    crashed: list[str] = []

    def client(index: int) -> None:
        try:
            _client(url, index, cast(int, seed), stop, out)
        except BaseException as exc:  # noqa: BLE001 - reported in the last line
            crashed.append(f"client {index}: {exc!r}")
    threads = [threading.Thread(target=client, args=(i,), name=f"chaos-client-{i}",
                                daemon=True) for i in range(cast(int, clients))]
    for thread in threads:
        thread.start()
    print("started", flush=True)

    def until_eof() -> None:
        sys.stdin.read()
        stop.set()
    threading.Thread(target=until_eof, name="chaos-clients-stdin", daemon=True).start()
    stop.wait(cast(float, max_seconds))
    stop.set()
    end = time.monotonic() + 60  # a request's own timeout is 30 s
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    for rec in list(out):
        print(json.dumps(as_fields(rec)))
    print(json.dumps({"alive": sum(t.is_alive() for t in threads), "crashed": crashed}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
