"""``calexec bench soak [--json] [--requests N] [--faults F] [--clients C] [--seed S]
[--decode-us US[:SHARE][,US[:SHARE]...]] [--max-tokens LO-HI] [--max-seconds T]
[--progress-s P] [--rss-bound-mib M] [--cancels SHARE]``: a long fault soak of the reference server (issue 28).

An in-process server (uvicorn on 127.0.0.1, an ephemeral port; the synthetic calbin on the
bundled emulator, ``calexec bench faults``' executor: execution deadline 0.4 s, no escalation
to Failed) serves ``--clients`` concurrent loopback clients until ``N`` requests were sent.
Each request is, at random, a plain (non-streaming) completion, a stream read at once, a stream
read by a slow reader (2-10 ms between two events) or a stream the client closes after its
first events (a disconnect: the server must cancel it and free everything); with ``--cancels
SHARE`` that share of the requests are streams an operator cancels (``cancel``: after their
first events the client sends ``POST /admin/cancel/{id}`` with the stream's response id and
reads on: a 202 must end the stream with the ``request.aborted`` error event, a 404 (it ended
first) with its own ``[DONE]``; the ``cancels`` check). Three quarters are
greedy over a pool of prompts, checked against the numpy oracle; a quarter are seeded sampled
requests from a small pool, checked against their fault-free answer taken before the first
fault. The run goes through decode-latency phases (``--decode-us``, default ``0,2000``: half
the requests at the zero-latency profile, half at a 2 ms decode, where implicit pre-arms and
greedy ahead run; ``US:SHARE`` weighs a phase). ``F`` faults are spread over the requests, one at
a time as ``calexec bench faults`` does (arm on one of the next 1-3 jobs, wait until it fired,
for Ready, and until every request in flight during it ended, sending a nudge request while a
request a KV fault refused waits for KV with no other request running; the traffic waits at each
fault's step until the fault is armed, so it always has requests to land on), cycling in seeded
order through every fault the emulator injects: drivers/tools/chaos.py's job-level and artifact faults
(§12 FI02-FI10, FI14) and a buffer map failure on a reload (``map_fail``).

Checks (each ``ok`` in ``checks``; the exit code is 1 when one fails, and the process says which):

* ``requests``: all ``N`` requests ran before ``--max-seconds``;
* ``faults``: every fault fired (each kind at least once when ``F`` >= the number of kinds);
* ``wrong_tokens``: every completed request's tokens (and a disconnected one's prefix) equal the
  oracle's / the fault-free reference's, and a completed one ends as a right answer does
  (``drivers/tools/answers.py``: its ``max_tokens`` tokens and ``length``, or the end token last and
  ``stop``): 0;
* ``client_errors``: 0 client-visible errors (HTTP error, SSE error event, transport error, a
  stream without ``[DONE]``) beyond the documented ones: a fault the server does not resume
  from (drivers/serving/resume.py: ARTIFACT and REQUEST_ARTIFACT failures: unknown CSR,
  slice failure) fails the request whose job met it with that fault's code
  (``calrt.csr_failed``, ``calrt.slice_failed``), at most one per firing of that fault, in its
  window; every other error counts;
* ``rss``: flat after warm-up within each decode-latency phase (sampled every second, when
  the warm-up ends, at each end of a phase and once more when the traffic ended, so a phase
  always has two ends to compare; each phase is its own workload, with its own number of
  requests in flight, so a phase is compared with itself): per phase, the median of the last
  third of its samples after its warm-up within ``--rss-bound-mib`` of the median of their
  first third (warm-up: the first 10 % of the requests for the first phase, the first fifth
  of a later phase's samples);
* ``objects``: the objects Python's collector tracks (``gc.get_objects()``), counted with the
  server idle before the traffic and after it, and, the traffic held at a gate until every
  request in flight ended, once after the warm-up and once late: from the warm-up count to
  the late one they grew by at most ``LIVE_OBJECTS_FLOOR`` + ``LIVE_OBJECTS_PER_REQUEST`` per
  request sent between them, and in all by at most ``LIVE_OBJECTS_SLACK``: anything a request
  leaves behind, one object per request, shows here whatever the allocator does with RSS. The
  warm-up count is taken at the first fault step once a full cycle of the fault kinds ran, a
  tenth of the requests went into the last decode-latency phase and the executor's ring of
  job trails is full, the late one at the last fault step; with no faults at a tenth of the
  requests (later when the ring would not be full by then) and at the last request. A run
  with faults but not more than one cycle of them has neither (the slack alone judges it).
  Until stop 73 the slack alone, 20000 from before the traffic: a leak of one object per
  request passed every run below about 15000 requests;
* ``pools``: at the end (idle, every fault cleared) every pool is as at the start: buffer slots
  per state, the device's free KV blocks, the KV coordinator's reserved tokens, sequence ids
  (all free, none withheld), jobs (queued, in flight, completing, pre-armed), requests active and
  releases pending;
* ``threads``: no thread the run started is alive once the server and executor stopped;
* ``cancels`` (``--cancels`` above 0 only): every cancel answered 202 or 404, a 202 ended its
  stream ``request.aborted`` and a 404 its own way, never both and never another answer, and
  the server's counters say what the clients saw: ``calexec_admin_cancels_total`` cancelled
  (+ repeated) the 202s and not_found the 404s, ``calexec_request_failures_total``
  ``request.aborted`` the aborted streams.

The process runs with ``calexec serve``'s memory policy: glibc's mmap threshold pinned
(drivers/memory.py; ``mmap_threshold_pinned`` in the report says whether it could be: False
where the C library is not glibc). Without it glibc's dynamic threshold sends the large arrays
of every request and every rebuilt generation to per-thread arenas that keep them after they
are freed, and RSS climbs with no leak behind it. Measured, ``--requests 12000 --faults 120
--clients 12 --max-tokens 2-6 --decode-us 0`` (76 recoveries): without the policy RSS went 112
-> 614 MiB (the rss check failed, +209 MiB; the soaks before 2026-12-02 ran so); with the
allocator held to two arenas (``MALLOC_ARENA_MAX=2``) it stayed at 176-242 MiB (-8.5); with
the threshold pinned, 108.5 -> 136-141 MiB, max 145 (+1.6) and every check passed.

Progress goes to stderr every ``--progress-s`` seconds. Needs the ``[server]`` extra.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calexec import cliargs
from calexec.drivers.memory import pin_mmap_threshold
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.drivers.tools.answers import answer_wrong

if TYPE_CHECKING:  # (the server's modules need the [server] extra: imported by run_soak)
    from calexec.drivers.serving.service import ServerConfig

MODES = ("plain", "stream", "slow", "disconnect")
#: the mode of a request an operator cancels mid-stream (``--cancels``: drawn before ``MODES``)
CANCEL_MODE = "cancel"
#: the faults a request is not resumed from (drivers/serving/resume.py): the request whose job
#: met one fails with that job's failure; everything else is resumed within the budget
NOT_RESUMED = frozenset({"unknown_csr", "slice_fail"})
#: the error code the request whose job met each of them fails with (``classify_errors``: only
#: that error is documented in the fault's window)
NOT_RESUMED_CODES = {"unknown_csr": "calrt.csr_failed", "slice_fail": "calrt.slice_failed"}
#: a request's timeout (its body's deadline and its client's bound) for a few tokens; a request
#: of up to ``hi`` tokens gets ``PER_TOKEN_S`` more a token (:func:`request_timeout`)
REQUEST_TIMEOUT_S = 60.0
#: a slow reader's longest pause between two events (``SLOW_READ_S``) and a decode step on the
#: busy 2-core host at the slowest phase, with room: a long request's deadline grows with it
PER_TOKEN_S = 0.05
#: a slow reader's pause between two events (seconds, drawn uniformly)
SLOW_READ_S = (0.002, 0.01)
IDLE_WAIT_S = 30.0
THREAD_WAIT_S = 10.0
WARM_SHARE = 0.1  # the first 10 % of the requests: the RSS baseline is taken after them
PHASE_WARM_SHARE = 0.2  # a later phase's first fifth of RSS samples: its warm-up
#: growth of the collector's live objects between the idle server before and after the traffic
#: that the ``objects`` check allows: first-use caches (a recovery's, an error path's) fill
#: once, most of them in the warm-up
LIVE_OBJECTS_SLACK = 20_000
#: growth of the live objects from the idle server after the warm-up to the idle server after
#: the traffic that the ``objects`` check allows: this many, plus
#: ``LIVE_OBJECTS_PER_REQUEST`` for each request sent after the warm-up. Measured (2026-12-07):
#: each fault kind's first fault and each phase's first requests add hundreds of objects (the
#: first two recoveries about a thousand each), a fault of a kind seen before tens (the fault
#: controller's and the recoveries' bounded records), an idle count some hundreds either way
#: (the server's objects of connections just closed); the executor's ring of the last
#: ``job_trails_kept`` jobs' trails grows by about 4000 until it is full. A clean run of 2400
#: requests grew by about 500 from its warm-up to its late count; a leak of one object per
#: request grows by one a request, past the bound from about 1200 requests after the warm-up
LIVE_OBJECTS_FLOOR = 1000
LIVE_OBJECTS_PER_REQUEST = 0.1
#: ``ExecutorConfig.job_trails_kept``'s default (the soak's executor keeps that many)
JOB_TRAILS_KEPT_DEFAULT = 1024
SAMPLED_SHARE = 0.25
SAMPLED_POOL = 32
PROMPT_POOL = 256
#: the longest prompt of the traffic (``_Traffic``: 1 to this many ids)
MAX_PROMPT_TOKENS = 16
#: the most tokens a request may ask for: the longest prompt and them fit the synthetic
#: model's context (``max_seq``); more is the server's 400 ``context_length_exceeded``
MAX_TOKENS = calbin_fmt.MAX_SEQ - MAX_PROMPT_TOKENS
EXAMPLES = 3


class SoakError(RuntimeError):
    """The soak could not run (the server or executor did not start, a bad argument)."""


@dataclass(frozen=True)
class Phase:
    decode_us: int
    share: float


@dataclass
class Hooks:
    """Test seams (tests/test_soak.py shows that each check can fail through them).

    ``tokens(body, tokens)``: what the checker sees of a completed request's tokens;
    ``after_traffic(service, executor)``: called once the server is idle, before the pools are
    read at the end; ``rss()``: the monitor's RSS sample; ``objects()``: the live-object
    count."""

    tokens: Callable[[dict[str, Any], list[int]], list[int]] | None = None
    after_traffic: Callable[[Any, Any], None] | None = None
    #: the RSS sampler (bytes or None); default: this process's, from /proc
    rss: Callable[[], int | None] | None = None
    #: the live-object counter; default: ``live_objects`` (a full collection, then a count)
    objects: Callable[[], int] | None = None
    #: called with the fault's index right before it is armed (a slow schedule, in the tests),
    #: once every request in flight before it ended and was counted (``tokens`` called)
    before_arm: Callable[[int], None] | None = None


def parse_phases(text: str) -> list[Phase]:
    """``US[:SHARE][,...]`` -> phases whose shares sum to 1 (a missing share weighs 1)."""
    phases: list[tuple[int, float]] = []
    for part in text.split(","):
        us, _, share = part.strip().partition(":")
        # (ASCII digits, as every number of the command line: Python's int() and float() read
        # "1_0" as 10 and "٣" as 3, which were taken until stop 74)
        given_us = cliargs.ascii_integer(us)
        given_share = cliargs.ascii_number(share) if share else 1.0
        if given_us is None or given_share is None:
            raise ValueError(f"--decode-us={text!r}: {part!r} is not US or US:SHARE (US an "
                             "integer of us in ASCII digits, SHARE a number > 0)")
        decode_us, weight = given_us, given_share
        if decode_us < 0 or decode_us > 1_000_000:
            raise ValueError(f"--decode-us={text!r}: {decode_us} is outside 0..1000000 us")
        if not 0 < weight < math.inf:  # (nan fails both; inf would make every share nan)
            raise ValueError(f"--decode-us={text!r}: share {share!r} of {us} must be > 0 and "
                             "finite")
        phases.append((decode_us, weight))
    total = sum(w for _, w in phases)
    if total == math.inf:
        raise ValueError(f"--decode-us={text!r}: the shares overflow; use smaller numbers")
    return [Phase(us, w / total) for us, w in phases]


def parse_range(text: str) -> tuple[int, int]:
    """``LO-HI`` or ``N`` -> (lo, hi), 1 <= lo <= hi <= :data:`MAX_TOKENS` (a request asking
    for more than the model's context holds is refused by the server: the soak would start it,
    then end at its first request)."""
    lo, dash, hi = text.partition("-")
    # (a dash with nothing after it, '4-', was taken for 4 alone, not refused; "1_0-2_0" and
    # "٣" were read by int() as 10-20 and 3 until stop 74)
    low, high = cliargs.ascii_integer(lo), cliargs.ascii_integer(hi if dash else lo)
    if low is None or high is None:
        raise ValueError(f"--max-tokens={text!r}: not N or LO-HI (integers in ASCII digits, "
                         f"e.g. 4-8)")
    pair = (low, high)
    if not 1 <= pair[0] <= pair[1]:
        raise ValueError(f"--max-tokens={text!r}: needs 1 <= LO <= HI")
    if pair[1] > MAX_TOKENS:
        raise ValueError(f"--max-tokens={text!r}: at most {MAX_TOKENS} tokens (the synthetic "
                         f"model's context of {calbin_fmt.MAX_SEQ} holds a prompt of up to "
                         f"{MAX_PROMPT_TOKENS} and them)")
    return pair


def live_objects() -> int:
    """The objects the collector tracks after a full collection (containers: a leaked request
    leaves at least one)."""
    gc.collect()
    return len(gc.get_objects())


def rss_bytes() -> int | None:
    """This process's resident set now (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Outcome:
    tokens: list[int]
    finish: str | None
    error: str | None = None
    message: str = ""
    #: ``cancel`` mode: the HTTP status the cancel answered (None: none sent)
    cancel: int | None = None


@dataclass
class Tally:
    """What the clients saw, counted as they go (nothing per request is kept: the RSS of a
    quarter-million-request run must stay flat)."""

    total: int
    mu: threading.Lock = field(default_factory=threading.Lock)
    issued: int = 0
    finished: int = 0
    completed: int = 0
    by_mode: Counter = field(default_factory=Counter)
    wrong: int = 0
    wrong_examples: list[dict[str, Any]] = field(default_factory=list)
    errors: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, kind
    error_examples: dict[str, str] = field(default_factory=dict)
    #: ``cancel`` mode: cancels sent by the HTTP status they answered, streams that ended
    #: ``request.aborted``
    cancels: Counter = field(default_factory=Counter)
    aborted: int = 0

    gate: int = -1  # the requests may not pass it (the fault schedule's pace); -1: total
    cond: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.cond = threading.Condition(self.mu)
        if self.gate < 0:
            self.gate = self.total

    def set_gate(self, gate: int) -> None:
        with self.cond:
            self.gate = min(gate, self.total)
            self.cond.notify_all()

    def take(self, stop: threading.Event, deadline: float) -> bool:
        """Whether the client sends one more request: waits (until ``deadline``) while the
        fault schedule holds the traffic at its gate."""
        with self.cond:
            while (not stop.is_set() and self.issued >= self.gate
                   and self.issued < self.total and time.monotonic() < deadline):
                self.cond.wait(0.1)
            if stop.is_set() or self.issued >= min(self.gate, self.total):
                return False
            self.issued += 1
            return True


def _read(http, body: dict[str, Any], mode: str, rng: random.Random) -> Outcome:
    """One request as ``mode`` reads it; never raises (a transport error is an outcome)."""
    from calexec.drivers.tools.bench.fault_cost import http_error

    try:
        if mode == "plain":
            r = http.post("/v1/completions", json=body)
            if r.status_code != 200:
                return Outcome([], None, *http_error(r))
            choice = r.json()["choices"][0]
            return Outcome(list(choice["token_ids"]), choice.get("finish_reason"))
        tokens: list[int] = []
        finish = None
        keep = (rng.randint(1, max(1, body["max_tokens"] - 1))
                if mode in ("disconnect", CANCEL_MODE) else 0)
        told: int | None = None  # the cancel's HTTP status (``cancel`` mode), once sent
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return Outcome([], None, *http_error(r))
            for line in r.iter_lines():
                if not line:
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    if told == 202:  # told, yet it ended whole: never both
                        return Outcome(tokens, None, "cancel 202 but [DONE]", "")
                    return Outcome(tokens, finish, cancel=told)
                event = json.loads(data)
                if "error" in event:
                    code = event["error"].get("code")
                    if told == 202 and code == "request.aborted":
                        return Outcome(tokens, "cancelled", cancel=told)
                    return Outcome(tokens, None, f"SSE error {code}",
                                   str(event["error"].get("message", "")), cancel=told)
                choice = event["choices"][0]
                tokens += choice["token_ids"]
                finish = choice.get("finish_reason") or finish
                if mode == "disconnect" and len(tokens) >= keep:
                    return Outcome(tokens, "disconnected")  # leaving the block closes it
                if mode == CANCEL_MODE and told is None and len(tokens) >= keep:
                    told = _cancel(http, event["id"])
                    if told not in (202, 404):
                        return Outcome(tokens, None, f"cancel HTTP {told}", "", cancel=told)
                if mode == "slow":
                    time.sleep(rng.uniform(*SLOW_READ_S))
        return Outcome(tokens, None, "stream ended without [DONE]", f"{len(tokens)} tokens")
    except Exception as err:  # noqa: BLE001 - a transport error is what the client saw
        return Outcome([], None, f"transport {type(err).__name__}", str(err)[:200])


def _cancel(http, response_id: str) -> int:
    """An operator's ``POST /admin/cancel/{id}`` of the stream ``response_id``: its status."""
    from calexec.drivers.tools.chaos import AUTH

    return http.post(f"/admin/cancel/{response_id}", headers=AUTH).status_code


def request_timeout(max_tokens: int) -> float:
    """The timeout of the soak's requests of up to ``max_tokens`` tokens: ``REQUEST_TIMEOUT_S``
    and ``PER_TOKEN_S`` a token. A fixed 60 s failed every run of ``--max-tokens`` past a few
    thousand (the fault-free references first: ``HTTP 504 ... timeout=60 s passed after 4325
    generated tokens``), where a slow reader alone takes up to 10 ms a token."""
    return REQUEST_TIMEOUT_S + max_tokens * PER_TOKEN_S


class _Traffic:
    """The request mix: greedy prompts checked against the oracle, sampled bodies against
    their fault-free reference."""

    def __init__(self, seed: int, tokens: tuple[int, int], cancels: float = 0.0) -> None:
        rng = random.Random(seed)
        self.lo, self.hi = tokens
        #: the share of requests an operator cancels mid-stream (``--cancels``)
        self.cancels = cancels
        #: every request's ``timeout`` (and its client's bound): :func:`request_timeout`
        self.timeout = request_timeout(self.hi)
        self.prompts = [tuple(rng.randrange(1, 150000)
                              for _ in range(rng.randint(1, MAX_PROMPT_TOKENS)))
                        for _ in range(PROMPT_POOL)]
        self.sampled = [{"prompt": list(self.prompts[rng.randrange(PROMPT_POOL)]),
                         "max_tokens": rng.randint(self.lo, self.hi),
                         "temperature": rng.choice([0.7, 1.0, 1.5]),
                         "seed": rng.randrange(1 << 31)} for _ in range(SAMPLED_POOL)]
        self.references: dict[int, list[int]] = {}

    def pick(self, rng: random.Random) -> tuple[dict[str, Any], list[int]]:
        """(a request body without ``stream``, the tokens it must produce)."""
        from calexec.drivers.tools.chaos import oracle_tokens

        if rng.random() < SAMPLED_SHARE and self.references:
            k = rng.randrange(len(self.sampled))
            return dict(self.sampled[k], timeout=self.timeout), self.references[k]
        prompt = self.prompts[rng.randrange(PROMPT_POOL)]
        n = rng.randint(self.lo, self.hi)
        expected = list(oracle_tokens(prompt, self.hi)[:n])
        return {"prompt": list(prompt), "max_tokens": n, "timeout": self.timeout}, expected


def _wrong(outcome: Outcome, expected: list[int], max_tokens: int) -> bool:
    tokens = outcome.tokens
    if outcome.finish in ("disconnected", "cancelled"):
        return tokens != expected[:len(tokens)]
    return answer_wrong(tokens, outcome.finish, expected, max_tokens)


def _client(url: str, index: int, seed: int, stop: threading.Event, tally: Tally,
            traffic: _Traffic, current: list[float | None], hooks: Hooks,
            deadline: float) -> None:
    import httpx

    rng = random.Random(seed * 1000 + index)
    with httpx.Client(base_url=url, timeout=traffic.timeout) as http:
        while tally.take(stop, deadline):
            # (drawn only with --cancels: a run without keeps its seeded schedule)
            mode = (CANCEL_MODE if traffic.cancels and rng.random() < traffic.cancels
                    else MODES[rng.randrange(len(MODES))])
            body, expected = traffic.pick(rng)
            body["stream"] = mode != "plain"
            started = current[index] = time.monotonic()
            try:
                outcome = _read(http, body, mode, rng)
                if outcome.error is None and hooks.tokens is not None:
                    outcome.tokens = hooks.tokens(body, outcome.tokens)
                _count(tally, outcome, body, mode, expected, started)
            finally:
                # in flight until counted: the fault schedule waits for the requests in
                # flight to end, then reads what they did (``Hooks.before_arm``)
                current[index] = None


def _count(tally: Tally, outcome: Outcome, body: dict[str, Any], mode: str,
           expected: list[int], started: float) -> None:
    wrong = outcome.error is None and _wrong(outcome, expected, body["max_tokens"])
    with tally.mu:
        tally.finished += 1
        tally.by_mode[mode] += 1
        if outcome.cancel is not None:
            tally.cancels[str(outcome.cancel)] += 1
        if outcome.finish == "cancelled":
            tally.aborted += 1
        if outcome.error is not None:
            tally.errors.append((started, time.monotonic(), outcome.error))
            tally.error_examples.setdefault(outcome.error, outcome.message)
            return
        if outcome.finish not in ("disconnected", "cancelled"):
            tally.completed += 1
        if wrong:
            tally.wrong += 1
            if len(tally.wrong_examples) < EXAMPLES:
                tally.wrong_examples.append({"request": body, "mode": mode,
                                             "tokens": outcome.tokens,
                                             "expected": expected})


def _pools(executor, service) -> dict[str, Any]:
    """Every pool's occupancy now (module docstring: ``pools``)."""
    gen = executor.gen
    snap = executor.snapshot()
    kv_free = kv_capacity = reserved = None
    if gen is not None:
        free_blocks = getattr(gen.kv, "free_blocks", None)  # the emulator's KvManager has it
        if free_blocks is not None:
            rc, kv_free = free_blocks()
            kv_free = kv_free if rc == 0 else None
        kv_capacity = gen.kvc.capacity_blocks()
        reserved = sum(view.reserved_len for view in list(gen.kvc.seqs.values()))
    return {"buffer_slots": snap["slots"], "kv_free_blocks": kv_free,
            "kv_capacity_blocks": kv_capacity, "kv_reserved_tokens": reserved,
            "sequence_ids": service.sequences.counts(),
            "jobs": {"queued": snap["queued"], "inflight": snap["inflight"],
                     "completing": snap["completing"], "auto_armed": snap["auto_armed"]},
            "requests_active": service.active, "releases_pending": service.releases_pending}


def _pools_back(start: dict[str, Any] | None, end: dict[str, Any] | None) -> bool:
    """Every pool as at the start. Buffer slots: none leased or in flight, each slot free or
    quarantined (a Wait failure or a failed UndoSlice quarantines its slot, FI07/FI15, until the
    generation's next reset returns it: it is not lost), the same number in all."""
    if start is None or end is None:
        return False
    if {k: v for k, v in start.items() if k != "buffer_slots"} != \
            {k: v for k, v in end.items() if k != "buffer_slots"}:
        return False
    first, last = start["buffer_slots"] or {}, end["buffer_slots"] or {}
    return (not last.get("Leased") and not last.get("InFlight")
            and sum(first.values()) == sum(last.values())
            and last.get("Free", 0) + last.get("Quarantined", 0) == first.get("Free", 0))


def _idle(executor, service) -> bool:
    snap = executor.snapshot()
    return (service.active == 0 and service.releases_pending == 0
            and service.sequences.counts()["in_use"] == 0 and executor.state == "Ready"
            and not executor.health() and snap["inflight"] == 0 and snap["queued"] == 0
            and snap["completing"] == 0 and snap["auto_armed"] == 0)


def _settle(since: float, current: list[float | None], kv_waiting: Callable[[], int],
            nudge: Callable[[], None]) -> None:
    """Wait (at most ``REQUEST_TIMEOUT_S``) until every request in flight at ``since``
    ended. A request a KV fault refused (``can_allocate_false``, ``apply_false``) waits for
    another request to give KV back or to ask for KV after it (FI04: woken by releases, never
    by polling); with the traffic held at the next fault's step none comes, and it waited out
    its whole deadline (429 ``kv.deadline``, an error beyond the budget: 2 clients and 3
    requests a step, when the fault met a step's last request; with one client, always). So
    while every request in flight waits for KV (no other one runs to give KV back or ask
    after it: the traffic held at the step, or every client waiting so), one nudge request at
    a time is sent (``kv_nudges`` in the report), as more traffic would have been."""
    from calexec.drivers.tools.bench.fault_cost import wait_until

    end = time.monotonic() + REQUEST_TIMEOUT_S

    def ended() -> bool:
        return all(c is None or c >= since for c in current)

    def starved() -> bool:
        waiting = kv_waiting()
        return waiting > 0 and sum(c is not None for c in current) <= waiting

    while not ended() and time.monotonic() < end:
        if wait_until(lambda: ended() or starved(), max(0.0, end - time.monotonic())) \
                and not ended():
            nudge()


def classify_errors(errors: list[tuple[float, float, str]], windows: list[dict[str, Any]]
              ) -> tuple[Counter, Counter]:
    """(documented errors by fault kind, errors beyond the budget by error kind): the error
    of a fault the server does not resume from (its code, ``NOT_RESUMED_CODES``) during that
    fault's window is documented, at most one per firing of that fault. Until stop 72 any
    error in the window was, whatever it was: a transport error or another code's 500 there
    passed the ``client_errors`` check."""
    allowance = [w["fired"] if w["kind"] in NOT_RESUMED else 0 for w in windows]
    documented: Counter = Counter()
    beyond: Counter = Counter()
    for start, end, kind in sorted(errors):
        k = next((j for j, w in enumerate(windows) if allowance[j] > 0
                  and kind.split()[-1] == NOT_RESUMED_CODES[w["kind"]]
                  and start <= w["ended"] and end >= w["armed"]), None)
        if k is None:
            beyond[kind] += 1
        else:
            allowance[k] -= 1
            documented[windows[k]["kind"]] += 1
    return documented, beyond


class _Monitor(threading.Thread):
    """Every 0.1 s: the decode profile of the current phase (re-applied: a recovery may reset
    the device's knobs); every second: an RSS sample; every ``progress_s``: a progress line."""

    def __init__(self, emu, tally: Tally, phases: list[Phase], progress_s: float,
                 status: Callable[[], str], counters: Callable[[], dict[str, int]],
                 rss: Callable[[], int | None] = rss_bytes) -> None:
        super().__init__(name="bench-soak-monitor", daemon=True)
        self.emu, self.tally, self.phases = emu, tally, phases
        self.progress_s, self.status = progress_s, status
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        #: (s since start, bytes, phase index), at most one a second
        self.rss: list[tuple[float, int, int]] = []
        self.rss_warm: int | None = None
        self.rss_warm_t: float | None = None  # when it was taken (s since start)
        self.phase = 0
        self.counters = counters
        self.sample_rss = rss
        #: the decode counters when each phase began (and, appended at the end, now)
        self.marks: list[dict[str, int]] = []
        self.profile_errors = 0
        self.bounds = []
        acc = 0.0
        for phase in phases:
            acc += phase.share
            self.bounds.append(round(acc * tally.total))

    def current(self) -> Phase:
        return self.phases[self.phase]

    def final_sample(self) -> None:
        """One more RSS sample once the traffic ended (the monitor stopped): a short run has
        at least two after its warm-up, so the growth check always has two ends to compare."""
        rss = self.sample_rss()
        if rss is not None:
            self.rss.append((round(time.monotonic() - self.t0, 1), rss, self.phase))
            if self.rss_warm is None:
                self.rss_warm, self.rss_warm_t = rss, self.rss[-1][0]

    @staticmethod
    def _ends(values: list[int]) -> tuple[float, float] | None:
        """(median of the first third of ``values``, median of the last third); None when
        empty. Medians, not two single samples: RSS swings by tens of MiB as recoveries
        allocate and free generations (the 150,000-request soak: 707-875 MiB around a flat
        level), and one sample at either end would judge the swing."""
        if not values:
            return None
        k = max(1, len(values) // 3)
        return statistics.median(values[:k]), statistics.median(values[-k:])

    def growth(self) -> tuple[float, float] | None:
        """The whole run's (first third, last third) after the warm-up, bytes (reported; the
        check is per phase: ``phase_growth``)."""
        return self._ends([v for t, v, _ in self.rss
                           if self.rss_warm_t is not None and t >= self.rss_warm_t])

    def phase_growth(self) -> list[tuple[int, tuple[float, float] | None, int]]:
        """Per phase: (index, (first third, last third) of its samples after its warm-up or
        None, samples judged)."""
        out = []
        for j in range(len(self.phases)):
            values = [v for t, v, phase in self.rss if phase == j]
            if j == 0:
                values = [v for t, v, phase in self.rss if phase == 0
                          and self.rss_warm_t is not None and t >= self.rss_warm_t]
            else:
                values = values[int(len(values) * PHASE_WARM_SHARE):]
            out.append((j, self._ends(values), len(values)))
        return out

    def _sample(self, now: float, warm: bool) -> None:
        """One RSS sample of the current phase; ``warm``: the first one past the warm-up
        is the warm-up's mark."""
        rss = self.sample_rss()
        if rss is None:
            return
        if len(self.rss) >= 4096:  # keep it bounded: every other sample
            self.rss = self.rss[::2]
        self.rss.append((round(now - self.t0, 1), rss, self.phase))
        if self.rss_warm is None and warm:
            self.rss_warm, self.rss_warm_t = rss, self.rss[-1][0]

    def run(self) -> None:
        next_rss = next_line = time.monotonic()
        while not self.stop.wait(0.1):
            issued = self.tally.issued
            warm = issued >= WARM_SHARE * self.tally.total
            now = time.monotonic()
            if warm and self.rss_warm is None:
                next_rss = now  # the warm-up's end is sampled when it comes
            while self.phase < len(self.phases) - 1 and issued >= self.bounds[self.phase]:
                # a phase's last sample at its end, the next one's first at its start: each
                # phase has two ends to compare however fast its requests ran
                self._sample(now, warm)
                self.phase += 1
                self.marks.append(self.counters())
                next_rss = now
            us = self.phases[self.phase].decode_us
            if self.emu.set_latency(decode_us=us) != 0:
                self.profile_errors += 1
            if now >= next_rss:
                next_rss = now + 1.0
                self._sample(now, warm)
            if now >= next_line:
                next_line = now + self.progress_s
                print(f"bench soak: {now - self.t0:.0f}s decode_us={us} {self.status()}",
                      file=sys.stderr, flush=True)


def _sample_sum(registry, name: str, labels: dict[str, str]) -> float:
    """The sum of ``name``'s samples in ``registry`` whose labels include ``labels``."""
    return sum(sample.value for family in registry.collect() for sample in family.samples
               if sample.name == name
               and all(sample.labels.get(k) == v for k, v in labels.items()))


def soak_server_config(timeout: float) -> ServerConfig:
    """The soak server's ``ServerConfig``: its admin token, and a ``max_timeout_s`` (600 s by
    default) that takes the traffic's ``timeout`` (:func:`request_timeout`)."""
    from calexec.drivers.serving.service import ServerConfig
    from calexec.drivers.tools.chaos import TOKEN

    default = ServerConfig()
    return ServerConfig(admin_token=TOKEN, max_timeout_s=max(default.max_timeout_s, timeout))


def run_soak(requests: int, faults: int, clients: int, seed: int = 28,
             phases: list[Phase] | None = None, max_tokens: tuple[int, int] = (4, 8),
             max_seconds: float = 3600.0, progress_s: float = 30.0,
             rss_bound_mib: float = 64.0, hooks: Hooks | None = None,
             native_relay: bool = False, inflight_capacity: int = 1,
             cancels: float = 0.0) -> dict[str, Any]:
    """One soak; the report (module docstring), ``ok`` False when a check failed.
    ``native_relay``: the executor's submitter on its native relay (``--native-relay``);
    ``inflight_capacity`` 2: Phase B, two jobs on the device (``--inflight-capacity``);
    ``cancels``: the share of requests an operator cancels mid-stream (``--cancels``)."""
    import httpx

    from calexec.drivers.calrt.runtime import Fault, FaultMode, bundled_emulator
    from calexec.drivers.serving.server import create_app
    from calexec.drivers.tools.bench.core import cpu_model
    from calexec.drivers.tools.bench.fault_cost import (
        FIRE_WAIT_S,
        READY_WAIT_S,
        BenchError,
        bench_executor,
        wait_until,
    )
    from calexec.drivers.tools.chaos import AUTH, FAULTS, LiveServer, arm_fault

    phases = phases or parse_phases("0,2000")
    hooks = hooks or Hooks()
    points = {name: (point, rc) for name, point, rc in FAULTS}
    kinds = [name for name, _, _ in FAULTS] + ["map_fail"]
    rng = random.Random(seed)
    traffic = _Traffic(seed, max_tokens, cancels)
    def due(i: int) -> int:  # fault i is armed once this many requests were sent
        return (i + 1) * requests // (faults + 1)
    # the traffic is held at fault i's step until it is armed, then runs on to the next step:
    # every fault meets traffic (the last one too), however long the schedule takes to arm it
    # (a recovery, in-flight requests draining, a busy host). The first step is set before
    # any client starts: set after them, more clients than that step's requests (--clients
    # 64, --requests 50 --faults 2) had sent every request before it was set, so the faults
    # were armed with no traffic left (not fired), and a request a KV fault refused had no
    # other request to give KV back (429 kv.deadline after its whole deadline, FI04)
    # the objects of the idle server after the warm-up are counted at the first fault step
    # once every fault kind met traffic (a full cycle of them), ``warm_at`` requests were sent
    # (a tenth of the requests into the last decode-latency phase) and the executor's ring of
    # job trails is full (``job_trails_kept`` jobs, a few objects each: it grows for the first
    # thousand jobs); each kind's first fault and each phase's first requests fill caches of
    # hundreds of objects too. With no faults they are counted at ``warm_at``, or later when the
    # ring would not be full by then (held there, the traffic is let go once they were
    # counted). A run with faults but no full cycle of them has no such count
    warm_at = max(1, round(sum(p.share for p in phases[:-1]) * requests)
                  + math.ceil(WARM_SHARE * requests))
    if faults == 0:  # (about (lo + hi) / 2 tokens a request, a job each; half that, to be sure)
        warm_at = min(requests, max(warm_at, math.ceil(4 * JOB_TRAILS_KEPT_DEFAULT
                                                       / (max_tokens[0] + max_tokens[1]))))
    tally = Tally(requests, gate=due(0) if faults > 0 else warm_at)
    problems: list[str] = []
    windows: list[dict[str, Any]] = []
    not_fired: Counter = Counter()
    reloads: Counter = Counter()  # map_fail's reloads by HTTP status
    threads_before = set(threading.enumerate())
    t_start = time.monotonic()
    deadline = t_start + max_seconds
    stop = threading.Event()
    current: list[float | None] = [None] * clients
    with tempfile.TemporaryDirectory(prefix="calexec-bench-soak-") as tmp:
        try:
            executor = bench_executor(Path(tmp), native_relay, inflight_capacity)
        except BenchError as exc:  # (its message says the executor did not start, and why)
            raise SoakError(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - said in one line by main
            raise SoakError(f"executor did not start: {exc}") from exc
        calbin_path = executor.gen.calbin_path if executor.gen is not None else ""
        app = create_app(executor, soak_server_config(traffic.timeout))
        service = app.state.service
        metrics = service.metrics.registry
        emu = bundled_emulator(executor.device)
        def decode_counters() -> dict[str, int]:
            """The server's decode steps (pre-armed, greedy ahead) and the executor's implicit
            pre-arms so far."""
            get = metrics.get_sample_value
            return {"decode_steps_prearmed": int(get("calexec_decode_steps_total",
                                                     {"prearmed": "true"}) or 0),
                    "decode_steps_ahead": int(get("calexec_decode_steps_ahead_total") or 0),
                    "auto_prearmed": int(executor.snapshot().get("auto_prearmed", 0)),
                    # steps the submitter inferred from its native relay (--native-relay)
                    "relay_submitted": int(executor.snapshot().get("relay_submitted", 0))}
        monitor = _Monitor(emu, tally, phases, progress_s, counters=decode_counters,
                           rss=hooks.rss or rss_bytes, status=lambda: (
            f"requests {tally.finished}/{requests} faults {len(windows)}/{faults} "
            f"wrong {tally.wrong} errors {len(tally.errors)} rss "
            f"{(rss_bytes() or 0) >> 20} MiB"))
        nudges: Counter = Counter()  # the nudge requests (``_settle``) by HTTP status
        # the server's count of the cancels and of the requests they ended (read at the end)
        counted_cancels: dict[str, float] = dict.fromkeys(
            ("cancelled", "repeated", "not_found", "ambiguous"), 0.0)
        counted_aborted = 0.0

        def nudge(admin) -> None:
            r = admin.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1,
                                                    "timeout": REQUEST_TIMEOUT_S})
            nudges[str(r.status_code)] += 1
            if r.status_code != 200:
                problems.append(f"a nudge request answered {r.status_code}: {r.text[:200]}")
        start_pools = end_pools = None
        # the client threads: joined on every way out (an interrupt too: they ran on after
        # `interrupted` was said, and a second Ctrl-C then met the interpreter waiting for
        # them at exit, a traceback on the terminal)
        workers: list[threading.Thread] = []
        objects_start: int | None = None
        # the idle server's objects after the warm-up and again late in the traffic, each with
        # the clients held at a gate (their own objects alive: an end count, the clients gone,
        # read hundreds fewer), and the requests sent by then
        objects_warm: int | None = None
        warm_sent = 0
        objects_late: int | None = None
        late_sent = 0
        objects_end: int | None = None
        count_objects = hooks.objects or live_objects
        lifecycle_end = None
        try:
            with LiveServer(app) as server:
                # the sampled references, fault-free, before any fault (and warm-up)
                with httpx.Client(base_url=server.url, timeout=traffic.timeout) as http:
                    for k, body in enumerate(traffic.sampled):
                        got = _read(http, {**body, "stream": False,
                                           "timeout": traffic.timeout}, "plain", rng)
                        if got.error is not None:
                            raise SoakError(f"fault-free reference {k} failed: {got.error} "
                                            f"{got.message}")
                        traffic.references[k] = got.tokens
                # (an answer can reach its client before the completion thread has given
                # its job's buffer slot back: the pools are read once the server is idle, as
                # at the end)
                if not wait_until(lambda: _idle(executor, service), IDLE_WAIT_S):
                    raise SoakError(f"the server did not go idle in {IDLE_WAIT_S}s after the "
                                    f"fault-free references: {_pools(executor, service)}")
                start_pools = _pools(executor, service)
                objects_start = count_objects()
                monitor.marks.append(decode_counters())
                monitor.start()
                workers[:] = [threading.Thread(
                    target=_client, args=(server.url, i, seed, stop, tally, traffic, current,
                                          hooks, deadline), name=f"bench-soak-client-{i}")
                    for i in range(clients)]
                for thread in workers:
                    thread.start()
                order = list(kinds)

                def trails_full() -> bool:
                    """The executor kept as many job trails as it keeps: at least that many
                    tokens were generated, each by a job of its own."""
                    tokens = metrics.get_sample_value("calexec_generation_tokens_total") or 0
                    return tokens >= executor.config.job_trails_kept

                def count_warm() -> None:
                    """The objects of the idle server after the warm-up (the traffic held at
                    its gate): counted once every request in flight ended; the first count
                    is the warm-up's, a later one the late count."""
                    nonlocal objects_warm, warm_sent, objects_late, late_sent
                    if not trails_full():
                        return
                    if wait_until(lambda: _idle(executor, service), IDLE_WAIT_S):
                        if objects_warm is None:
                            objects_warm, warm_sent = count_objects(), tally.issued
                        else:
                            objects_late, late_sent = count_objects(), tally.issued
                    else:
                        problems.append(f"the server did not go idle in {IDLE_WAIT_S}s after "
                                        f"the warm-up: {_pools(executor, service)}")

                with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as admin:
                    for i in range(faults):
                        wait_until(lambda i=i: tally.issued >= due(i) or stop.is_set()
                                   or time.monotonic() > deadline, max(0.0, deadline
                                                                       - time.monotonic()))
                        if tally.issued >= requests or time.monotonic() > deadline:
                            break  # the traffic ended first: the faults left did not run
                        if ((objects_warm is None or i == faults - 1) and i >= len(kinds)
                                and due(i) >= warm_at and tally.issued < requests):
                            count_warm()  # (the warm-up's, and the last fault step's)
                        if i % len(order) == 0:
                            rng.shuffle(order)
                        kind = order[i % len(order)]
                        if not wait_until(lambda: executor.state == "Ready"
                                          and not executor.health(), READY_WAIT_S):
                            problems.append(f"not Ready {READY_WAIT_S}s after a fault "
                                            f"(lifecycle {executor.state}: "
                                            f"{executor.health()})")
                            break
                        ready_at = time.monotonic()  # one fault at a time (bench faults)
                        wait_until(lambda ready_at=ready_at: all(
                            c is None or c >= ready_at for c in current), REQUEST_TIMEOUT_S)
                        if hooks.before_arm is not None:
                            hooks.before_arm(i)
                        armed = time.monotonic()
                        if kind == "map_fail":
                            first = Fault.MAP_FAIL
                            emu.set_fault(Fault.MAP_FAIL, FaultMode.NTH, 1)
                            r = admin.post("/admin/reload", json={"calbin": calbin_path},
                                           headers=AUTH)
                            # the serving calbin again: its refused generation is rolled
                            # back to a fresh one of the same calbin, so 200 (or an error)
                            reloads[str(r.status_code)] += 1
                        else:
                            point, rc = points[kind]
                            first = Fault[point.split("+")[0]]
                            arm_fault(emu, point, rng, rc)
                        tally.set_gate(due(i + 1) if i + 1 < faults else requests)
                        fired = wait_until(lambda first=first: emu.fault_stats(first)[2] >= 1,
                                           FIRE_WAIT_S)
                        n_fired = emu.fault_stats(first)[2]
                        emu.clear_all_faults()
                        wait_until(lambda: executor.state == "Ready" and not executor.health(),
                                   READY_WAIT_S)
                        _settle(time.monotonic(), current, lambda: (
                            executor.gen.kvc.waiting if executor.gen is not None else 0),
                            lambda: nudge(admin))
                        if fired:
                            windows.append({"kind": kind, "armed": armed, "fired": n_fired,
                                            "ended": time.monotonic()})
                        else:
                            not_fired[kind] += 1
                    if faults == 0:  # (held at ``warm_at``, then at the last request)
                        for gate in (warm_at, requests - 1):
                            tally.set_gate(gate)
                            wait_until(lambda gate=gate: tally.issued >= gate or stop.is_set()
                                       or time.monotonic() > deadline,
                                       max(0.0, deadline - time.monotonic()))
                            if warm_at <= tally.issued < requests and (
                                    time.monotonic() <= deadline):
                                count_warm()
                    tally.set_gate(requests)
                    wait_until(lambda: tally.issued >= requests, max(0.0, deadline
                                                                     - time.monotonic()))
                    stop.set()
                    bound = time.monotonic() + REQUEST_TIMEOUT_S + 10
                    for thread in workers:
                        thread.join(max(0.0, bound - time.monotonic()))
                    if any(thread.is_alive() for thread in workers):
                        problems.append("a client did not return")
                    emu.clear_all_faults()
                    if not wait_until(lambda: _idle(executor, service), IDLE_WAIT_S):
                        problems.append(f"the server did not go idle in {IDLE_WAIT_S}s: "
                                        f"{_pools(executor, service)}")
                    if hooks.after_traffic is not None:
                        hooks.after_traffic(service, executor)
                    end_pools = _pools(executor, service)
                    objects_end = count_objects()
                    lifecycle_end = executor.state
                monitor.stop.set()
                monitor.join(5.0)
                monitor.final_sample()
                monitor.marks.append(decode_counters())
                counters = executor.snapshot()
                exhausted = metrics.get_sample_value("calexec_resume_budget_exhausted_total")
                resumes = metrics.get_sample_value  # read below, before the server goes
                resumed = {cause: resumes("calexec_resumes_total", {"cause": cause})
                           for cause in ("device", "internal", "transient", "unknown",
                                         "lifecycle", "unavailable", "generation_replaced")}
                ahead = resumes("calexec_decode_steps_ahead_total") or 0.0
                counted_cancels = {outcome: _sample_sum(metrics, "calexec_admin_cancels_total",
                                                        {"outcome": outcome})
                                   for outcome in ("cancelled", "repeated", "not_found",
                                                   "ambiguous")}
                counted_aborted = _sample_sum(metrics, "calexec_request_failures_total",
                                              {"code": "request.aborted"})
                prearmed = resumes("calexec_decode_steps_total", {"prearmed": "true"}) or 0.0
        finally:
            stop.set()
            monitor.stop.set()
            emu.clear_all_faults()
            if not executor.lifecycle.final:
                executor.shutdown(10.0)
            bound = time.monotonic() + REQUEST_TIMEOUT_S + 10  # (the server is gone: at
            for thread in workers:  # most a request's end away; a Ctrl-C here still ends it)
                thread.join(max(0.0, bound - time.monotonic()))
    seconds = time.monotonic() - t_start
    wait_until(lambda: not set(threading.enumerate()) - threads_before, THREAD_WAIT_S)
    leaked = sorted(t.name for t in set(threading.enumerate()) - threads_before)
    documented, beyond = classify_errors(tally.errors, windows)
    by_kind = Counter(w["kind"] for w in windows)
    rss_first = monitor.rss[0][1] if monitor.rss else None
    rss_last = monitor.rss[-1][1] if monitor.rss else None
    warm = monitor.rss_warm
    ends = monitor.growth()
    by_phase = monitor.phase_growth()
    judged = [(j, e) for j, e, _ in by_phase if e is not None]
    worst = max((e[1] - e[0] for _, e in judged), default=None)
    objects_growth = (None if objects_start is None or objects_end is None
                      else objects_end - objects_start)
    # from the warm-up on: a bound that grows with the requests sent after it (none counted:
    # a run too short to have a warm-up step before its last request, judged by the slack)
    after_warm = (None if objects_warm is None or objects_late is None
                  else objects_late - objects_warm)
    warm_requests = late_sent - warm_sent
    warm_bound = LIVE_OBJECTS_FLOOR + LIVE_OBJECTS_PER_REQUEST * warm_requests
    mib = 1 << 20
    quarantined = ((end_pools or {}).get("buffer_slots") or {}).get("Quarantined", 0)
    checks = {
        "requests": {"ok": tally.issued == requests and tally.finished == requests,
                     "detail": f"{tally.finished} of {requests} requests ran"},
        "faults": {"ok": len(windows) == faults and (faults < len(kinds)
                                                     or set(by_kind) == set(kinds)),
                   "detail": f"{len(windows)} of {faults} fired; kinds not seen: "
                             f"{sorted(set(kinds) - set(by_kind)) if faults >= len(kinds) else []}"},
        "wrong_tokens": {"ok": tally.wrong == 0, "detail": f"{tally.wrong} wrong"},
        "client_errors": {"ok": not beyond and not exhausted,
                          "detail": f"{sum(beyond.values())} beyond the documented ones; "
                                    f"resume budgets exhausted: {int(exhausted or 0)}"},
        "rss": {"ok": worst is not None and worst <= rss_bound_mib * mib,
                "detail": "no RSS sample" if worst is None else
                          "per phase, median of the last third after warm-up vs the first "
                          "third: " + "; ".join(
                              f"decode_us={phases[j].decode_us} {e[1] / mib:.1f} vs "
                              f"{e[0] / mib:.1f} MiB ({(e[1] - e[0]) / mib:+.1f})"
                              for j, e in judged) + f"; bound +{rss_bound_mib} MiB"},
        "objects": {"ok": objects_growth is not None
                    and objects_growth <= LIVE_OBJECTS_SLACK
                    and (after_warm is None or after_warm <= warm_bound),
                    "detail": (f"live objects, idle before the traffic {objects_start}, idle "
                               f"after it {objects_end}: {objects_growth:+d}, bound "
                               f"+{LIVE_OBJECTS_SLACK}" + (
                                   f"; idle after the warm-up {objects_warm}, "
                                   f"{warm_requests} requests later {objects_late}: "
                                   f"{after_warm:+d}, bound "
                                   f"+{warm_bound:g} ({LIVE_OBJECTS_FLOOR} + "
                                   f"{LIVE_OBJECTS_PER_REQUEST:g} a request)"
                                   if after_warm is not None else "; no warm-up count"))
                    if objects_growth is not None
                    else "not counted (the traffic did not end)"},
        "pools": {"ok": _pools_back(start_pools, end_pools),
                  "detail": "every pool as at the start"
                  + (f" (buffer slots quarantined, until the next reset: {quarantined})"
                     if quarantined else "") if _pools_back(start_pools, end_pools)
                  else "start -> end: " + "; ".join(
                      f"{key} {(start_pools or {}).get(key)} -> {(end_pools or {}).get(key)}"
                      for key in sorted(set(start_pools or {}) | set(end_pools or {}))
                      if (start_pools or {}).get(key) != (end_pools or {}).get(key))},
        "threads": {"ok": not leaked, "detail": f"leaked: {leaked}"},
        "server": {"ok": not problems and lifecycle_end == "Ready",
                   "detail": f"lifecycle {lifecycle_end}; {problems}"},
    }
    if cancels > 0:
        told, missed = tally.cancels.get("202", 0), tally.cancels.get("404", 0)
        cancel_errors = sum(1 for _, _, kind in tally.errors if kind.startswith("cancel "))
        checks["cancels"] = {
            "ok": (counted_cancels["cancelled"] + counted_cancels["repeated"] == told
                   and counted_cancels["not_found"] == missed
                   and counted_cancels["ambiguous"] == 0 and tally.aborted == told
                   and counted_aborted == tally.aborted and not cancel_errors
                   and set(tally.cancels) <= {"202", "404"}),
            "detail": f"cancels sent by answer {dict(tally.cancels)}, streams aborted "
                      f"{tally.aborted}; the server counted {counted_cancels}, "
                      f"request.aborted {counted_aborted:g}; {cancel_errors} a 202 whose "
                      "stream ended otherwise"}
    return {
        "ok": all(c["ok"] for c in checks.values()),
        "checks": checks,
        "requests": requests, "requests_finished": tally.finished,
        "completed": tally.completed, "by_mode": dict(tally.by_mode),
        "cancels": dict(tally.cancels), "cancelled_streams": tally.aborted,
        "clients": clients, "seed": seed, "max_tokens": list(max_tokens),
        "phases": [{"decode_us": p.decode_us, "share": round(p.share, 4),
                    "until_request": b,
                    # what ran in the phase (the counters at its end minus at its start)
                    **({k: monitor.marks[j + 1][k] - monitor.marks[j][k]
                        for k in monitor.marks[j]} if j + 1 < len(monitor.marks) else {})}
                   for j, (p, b) in enumerate(zip(phases, monitor.bounds))],
        "profile_errors": monitor.profile_errors,
        "kv_nudges": dict(nudges),
        "faults_requested": faults, "faults_fired": len(windows),
        "faults_by_kind": dict(by_kind), "faults_not_fired": dict(not_fired),
        "map_fail_reloads": dict(reloads),
        "wrong_tokens": tally.wrong, "wrong_examples": tally.wrong_examples,
        "client_errors": len(tally.errors), "errors_documented": dict(documented),
        "errors_beyond_budget": dict(beyond), "error_examples": tally.error_examples,
        "resume_budget_exhausted": int(exhausted or 0),
        "resumes_by_cause": {k: int(v) for k, v in resumed.items() if v},
        "decode_steps_prearmed": int(prearmed), "decode_steps_ahead": int(ahead),
        "auto_prearmed": counters.get("auto_prearmed"),
        "native_relay": native_relay, "relay_submitted": counters.get("relay_submitted"),
        "inflight_capacity": inflight_capacity, "downgrades": counters.get("downgrades"),
        "inflight_capacity_end": counters.get("inflight_capacity"),
        "recoveries": counters.get("recoveries"),
        "rss_mib": {"first": None if rss_first is None else round(rss_first / mib, 1),
                    "after_warm_up": None if warm is None else round(warm / mib, 1),
                    "last": None if rss_last is None else round(rss_last / mib, 1),
                    # the largest growth of a phase (the check), and the whole run's
                    "growth": None if worst is None else round(worst / mib, 1),
                    "whole_run_growth": None if ends is None
                    else round((ends[1] - ends[0]) / mib, 1),
                    "by_phase": [{"decode_us": phases[j].decode_us, "samples": n,
                                  "first_third": None if e is None else round(e[0] / mib, 1),
                                  "last_third": None if e is None else round(e[1] / mib, 1),
                                  "growth": None if e is None
                                  else round((e[1] - e[0]) / mib, 1)}
                                 for j, e, n in by_phase],
                    "max": round(max(v for _, v, _ in monitor.rss) / mib, 1)
                    if monitor.rss else None,
                    "samples": len(monitor.rss),
                    # (s, MiB, phase) at most 32 points over the run: the trend
                    "trend": [[t, round(v / mib, 1), phase] for t, v, phase in
                              monitor.rss[::max(1, -(-len(monitor.rss) // 32))]]},
        "live_objects": {"start": objects_start, "end": objects_end,
                         "growth": objects_growth, "after_warm_up": objects_warm,
                         "late": objects_late,
                         "requests_after_warm_up": warm_requests if after_warm is not None
                         else None, "growth_after_warm_up": after_warm,
                         "bound_after_warm_up": warm_bound if after_warm is not None
                         else None},
        "pools_start": start_pools, "pools_end": end_pools,
        "threads_leaked": leaked,
        "seconds": round(seconds, 1),
        "requests_per_s": round(tally.finished / seconds, 2) if seconds > 0 else None,
        "cpu_model": cpu_model(), "cpus": os.cpu_count(),
    }


def _readable(report: dict[str, Any]) -> str:
    lines = [f"calexec bench soak: {'PASS' if report['ok'] else 'FAIL'} "
             f"({report['seconds']} s, {report['requests_per_s']} requests/s, "
             f"{report['cpu_model']}, {report['cpus']} cores)"]
    for name, check in report["checks"].items():
        lines.append(f"  {'ok  ' if check['ok'] else 'FAIL'} {name}: {check['detail']}")
    for key in ("requests_finished", "completed", "by_mode", "phases", "faults_by_kind",
                "faults_not_fired", "wrong_tokens", "client_errors", "errors_documented",
                "errors_beyond_budget", "error_examples", "resumes_by_cause",
                "decode_steps_prearmed", "decode_steps_ahead", "auto_prearmed",
                # whether the submitter ran on its native relay and what it gave to infer
                # there (--native-relay): the JSON had them, the readable report did not
                "native_relay", "relay_submitted", "inflight_capacity", "downgrades",
                "inflight_capacity_end",
                "recoveries",
                "rss_mib", "mmap_threshold_pinned", "live_objects", "pools_end",
                "threads_leaked"):
        lines.append(f"  {key}: {json.dumps(report[key])}")
    return "\n".join(lines)


def _mib_bound(text: str) -> float:
    """argparse type of ``--rss-bound-mib``: a number >= 0 (inf: no bound); nan compares false
    with everything, so it would pass the check below it and fail the run's rss check."""
    value = cliargs.ascii_number(text)  # (ASCII digits: float() also reads "1_0" and "٣")
    if value is None:  # (argparse would say "invalid _mib_bound value", this function's name)
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


#: a fault is armed on one of the next 1-3 calls of its point (chaos.arm_fault), and a point
#: may be met once per request only (a prefill's slice, say): each fault's share of the
#: requests must hold this many
REQUESTS_PER_FAULT = 3


def schedule_refusal(requests: int, faults: int, clients: int) -> str | None:
    """Why ``--requests``/``--faults``/``--clients`` cannot carry the fault schedule (None:
    they can). Fault i is armed once ``(i + 1) * requests // (faults + 1)`` requests were sent
    and the traffic is held there until it is (``due`` in ``run_soak``), so the requests
    between two steps, and after the last, number ``requests // (faults + 1)`` at least: that
    must be ``REQUESTS_PER_FAULT``. One client carries them too (until stop 59 ``--clients 1``
    was refused: a request ``can_allocate_false``/``apply_false`` refused waited for another
    request to give KV back and, with none, failed 429 ``kv.deadline`` at its deadline; the
    schedule now nudges it, ``_settle``)."""
    if faults == 0:
        return None
    least = REQUESTS_PER_FAULT * (faults + 1)
    if requests < least:
        return (f"argument --requests: {requests} cannot carry --faults {faults}: each fault "
                f"needs {REQUESTS_PER_FAULT} requests of its own and the traffic before the "
                f"first one its share too, so --requests >= {REQUESTS_PER_FAULT} * (faults + 1)"
                f" = {least} (or fewer --faults, or --faults 0)")
    return None


@cliargs.command_main
def main(argv: list[str]) -> int:
    return run_cli(argv)


def _share(text: str) -> float:
    """``--cancels``: a share in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # (nan too)
        raise argparse.ArgumentTypeError(f"--cancels={text[:40]!r}: a share in [0, 1]")
    return value


def run_cli(argv: list[str], hooks: Hooks | None = None) -> int:
    """``main`` with the test seams (tests/test_soak.py)."""
    parser = cliargs.parser("calexec bench soak", __doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=cliargs.count("bench soak --requests"), default=2000,
                        help="requests to send in all (250000: the issue's figure; at most "
                             f"{cliargs.MAX_COUNTS['bench soak --requests']})")
    parser.add_argument("--faults", type=cliargs.non_negative_int, default=50,
                        help="device faults spread over the requests, one at a time "
                             "(2500: the issue's figure)")
    parser.add_argument("--clients", type=cliargs.clients, default=8,
                        help="concurrent loopback clients")
    parser.add_argument("--seed", type=cliargs.non_negative_int, default=28,
                        help="seed of the schedule and prompts")
    parser.add_argument("--decode-us", default="0,2000",
                        help="decode-latency phases US[:SHARE],... in order")
    parser.add_argument("--max-tokens", default="4-8", help="tokens per request, N or LO-HI")
    parser.add_argument("--max-seconds", type=cliargs.seconds, default=3600.0,
                        help="bound of the whole run; the requests left are not sent")
    parser.add_argument("--progress-s", type=cliargs.seconds, default=30.0,
                        help="seconds between two progress lines on stderr")
    parser.add_argument("--rss-bound-mib", type=_mib_bound, default=64.0,
                        help="the last RSS sample may exceed the post-warm-up one by this")
    parser.add_argument("--native-relay", action="store_true",
                        help="the executor's submitter on its native relay "
                             "(ExecutorConfig.native_relay, serve --native-relay)")
    cliargs.add_inflight_capacity(parser)
    parser.add_argument("--cancels", type=_share, default=0.0,
                        help="share of the requests (0-1) an operator cancels mid-stream by "
                             "POST /admin/cancel/{id} (the cancels check)")
    args = parser.parse_args(argv[2:])
    try:
        phases = parse_phases(args.decode_us)
        tokens = parse_range(args.max_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    refusal = schedule_refusal(args.requests, args.faults, args.clients)
    if refusal is not None:
        parser.error(refusal)
    pinned = pin_mmap_threshold()  # the process is a server's: calexec serve's policy
    try:
        report = run_soak(args.requests, args.faults, args.clients, args.seed, phases, tokens,
                          args.max_seconds, args.progress_s, args.rss_bound_mib, hooks,
                          args.native_relay, args.inflight_capacity, args.cancels)
    except SoakError as exc:
        print(f"calexec bench soak: {exc}", file=sys.stderr)
        return 1
    report["mmap_threshold_pinned"] = pinned
    print(json.dumps(report) if args.json else _readable(report))
    if not report["ok"]:
        failed = [name for name, check in report["checks"].items() if not check["ok"]]
        print(f"calexec bench soak: checks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
