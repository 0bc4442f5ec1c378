"""The clients of the threaded fault soak (``calexec.drivers.tools.chaos``): each sends plain
and streaming completions, early disconnects and short timeouts in a seeded order, and keeps a
:class:`Record` of every request and what came back."""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx


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
