"""The completion service of the reference server: ``ServerConfig``, the KV sequence ids it
owns (``SequencePool``), one request in progress (``RequestRun``) and ``CompletionService``,
which admits, runs, resumes, finishes and drains requests around one executor. The routes
are in ``server.py`` (health, ready, metrics), ``openai_api.py`` (completions, chat,
tokenize), ``admin.py`` and ``debug.py``.

One completion: validate -> lease a KV sequence id from the free list -> PREFILL_IDS job at
past_len 0 reserving the KV of the whole request (prompt + max_tokens, all or nothing: no hold
and wait, §7) -> DECODE jobs (through the executor's pre-armed decode stream, ``ServerConfig.prearm``,
when the device is slow enough to pre-arm for) feeding
the chosen token back (drivers/serving/sampling.py), until ``max_tokens``, the end
token, the deadline or an error -> answer -> once the last job is resolved,
``executor.release_sequence`` -> id back to the free list (in the background when the job is
still running: a response is never later than the request deadline plus
``ServerConfig.deadline_slack_s``, and an id is never reused before its job ended). Blocking
executor calls (``enqueue``, opening a decode stream, a step's ``submit`` that must admit) run
in worker threads under per-app ``CapacityLimiter``s (a prefill that may wait for KV never
takes the threads the running requests need); waits park no thread (``inline_waits``: the
loop awaits ``wait_async`` and takes a ready step with ``submit_nowait``), and a non-streamed
greedy request runs all its jobs in one worker thread (``decode_bursts``); the event loop
never blocks on the device. A request whose client disconnects
is cancelled (FI12: ``JobHandle.cancel()``; a submitted job is still waited for and its result
discarded) and its sequence released once the job ends.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import contextvars
import hashlib
import itertools
import logging
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any, TypeVar, cast

import anyio
import attrs
import numpy as np
from anyio import to_thread

from calexec import __version__
from calexec.contracts import fields
from calexec.contracts.errors import Category
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import ModelGeneration, TaskKind
from calexec.drivers.serving import byte_tokenizer, hf_tokenizer, sampling, wire
from calexec.drivers.serving.admission import AdmissionQueue
from calexec.drivers.serving.dumpsink import DumpSink
from calexec.drivers.serving.error_bodies import invalid
from calexec.drivers.serving.executor_view import ServedExecutor
from calexec.drivers.serving.metrics import METRICS_NAMES, ServerMetrics, kv_usage_fraction
from calexec.drivers.serving.resume import KNOCK_ON_CODE, Resumer
from calexec.drivers.serving.rows import RowPool
from calexec.drivers.serving.sampling import GrammarSpec, RowConstraint
from calexec.drivers.serving.threads import WorkerPool
from calexec.machines.api import CompletionHandle
from calexec.machines.compiled import JOB

T = TypeVar("T")

log = logging.getLogger("calexec.server")
#: how many operator calls (``CompletionService.operator_call``: a calbin check, a model
#: switch, a job page's drawing) run in worker threads at once
OPERATOR_THREADS = 2
#: the ``reason`` of a model switch's record in ``executor.recoveries``
MODEL_SWITCH = "lifecycle.model_switch"
#: what a prompt past the context is told to shorten, per ``Admission.prompt_param``: OpenAI's
#: and vLLM's words for completions and chat (clients look for them); another route's field
#: (``input``, /v1/responses) by its own name
PROMPT_WORDS = {"prompt": "prompt or messages", "messages": "prompt or messages"}


#: OpenAI's ``error.code`` of a context overflow (error_bodies.OPENAI_CODE), also the last
#: words of its message (:func:`context_exceeded`)
CONTEXT_CODE = "context_length_exceeded"


def context_exceeded(message: str) -> Status:
    """A prompt, or prompt + max_tokens, longer than the model's context (400; OpenAI's code
    ``context_length_exceeded``, error_bodies.OPENAI_CODE). ``message`` (OpenAI's and vLLM's
    wording) ends with the code in parentheses: the openai SDK 3.x puts only the body's
    message in the exception's text, and LangChain (``ContextOverflowError``) tells an
    overflow from any other 400 by the code in that text (SDK 1.x and 2.x wrote the whole
    body there)."""
    return Status.failure("request.context_length_exceeded", Category.INVALID_REQUEST,
                          Phase.VALIDATE, f"{message} ({CONTEXT_CODE})")


#: an origin as browsers send it: scheme, host, optional port, no path ("*": any)
_ORIGIN = re.compile(r"(https?)://([^/\s:]+)(?::(\d{1,5}))?")
#: a host as a browser writes it in ``Origin``: lowercase ASCII (a name in punycode)
_ORIGIN_HOST = re.compile(r"[a-z0-9.-]+")
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def cors_origin_problem(origin: str) -> str | None:
    """Why ``origin`` can never match a browser's ``Origin`` header (None: it can). A browser
    writes the host in lowercase ASCII (punycode for a non-ASCII name) and leaves out the
    scheme's default port; the middleware compares the header with the setting as strings, so
    ``http://App.example``, ``http://é.example``, ``http://a.example:80`` or a port past 65535
    would never match (they were taken, and every page refused)."""
    if origin == "*":
        return None
    match = _ORIGIN.fullmatch(origin)
    if match is None:
        return (f"={origin[:100]!r}: must be '*' or scheme://host[:port] (http or https, no "
                "path), as a browser sends Origin")
    scheme, host, port = match.groups()
    if not _ORIGIN_HOST.fullmatch(host):
        return (f"={origin[:100]!r}: the host must be written as a browser sends it, lowercase "
                "ASCII (a non-ASCII name in punycode, xn--...)")
    if port is not None and (port.startswith("0") or not 1 <= int(port) <= 65535):
        return (f"={origin[:100]!r}: port {port} is not a TCP port (1..65535) as a browser "
                "writes it (no leading zero)")
    if port == _DEFAULT_PORTS[scheme]:
        return (f"={origin[:100]!r}: a browser leaves the default port {port} of {scheme} out "
                f"of Origin: write {scheme}://{host}")
    return None


def _check_cors(instance: Any, attribute: Any, origins: tuple[str, ...]) -> None:
    for origin in origins:
        problem = cors_origin_problem(origin)
        if problem is not None:
            raise ValueError(f"cors_origins: {origin[:100]!r}{problem}")


def api_key_problem(key: str) -> str | None:
    """Why no request could ever present ``key`` (None: one can). A request's key is its
    ``Authorization: Bearer`` header value, stripped: HTTP header values are latin-1 and
    clients send ASCII, so a key with a character outside printable ASCII (or one that is
    empty, or starts or ends with whitespace) would refuse every request. Phrased to follow
    the key's name; the key itself is never echoed (only the offending position)."""
    if not key.strip():
        return "is empty"
    if key != key.strip():
        return ("starts or ends with whitespace, which the Authorization header never "
                "carries (its value is stripped)")
    bad = next((i for i, c in enumerate(key) if not " " <= c <= "~"), None)
    if bad is not None:
        return (f"has U+{ord(key[bad]):04X} at character {bad + 1}, not printable ASCII: "
                "HTTP headers are latin-1 and clients send ASCII, so no request could ever "
                "match it")
    return None


def sequence_ids_problem(executor: ServedExecutor, max_sequences: int) -> str | None:
    """Why the server cannot lease sequence ids 1..``max_sequences`` on ``executor``'s
    KvManager (None: it can, or the runtime does not say how many it takes): ids must be
    below its ``max_seqs`` (0 is the warm-up's). Phrased to follow the setting's name."""
    max_seqs = getattr(getattr(executor, "kv", None), "max_seqs", None)
    if max_seqs is None or max_sequences < max_seqs:
        return None
    return (f"={max_sequences}: the device's KvManager takes sequence ids 0..{max_seqs - 1} "
            f"(max_seqs={max_seqs}; 0 is the warm-up's), so at most {max_seqs - 1}; requests "
            f"on {_id_range(max_seqs, max_sequences)} would be refused "
            "(kv.seq_id_out_of_range)")


def _id_range(first: int, last: int) -> str:
    """``id 64`` or ``ids 64..70``."""
    return f"id {first}" if first == last else f"ids {first}..{last}"


def _check_api_key(instance: Any, attribute: Any, key: str | None) -> None:
    """``api_key`` and ``admin_token``: a bearer token a request's header can carry."""
    problem = None if key is None else api_key_problem(key)
    if problem is not None:
        raise ValueError(f"{attribute.name} {problem}")


def _seconds(positive: bool = True) -> Callable[[Any, Any, Any], None]:
    """attrs validator of a seconds (or ms) setting: a finite number, > 0 when ``positive``
    else >= 0. An infinite one would reach the executor as a deadline or a wait it refuses
    (``request.invalid``), so every request or release would fail."""
    return fields.number(0, above=positive)


#: the longest served model name (``--served-model-name``, ``ServerConfig.model_name``): it
#: is in every response body and every metric series' ``model_name`` label; a path as long
#: as Linux's PATH_MAX is taken (vLLM names a model by its path)
MAX_MODEL_NAME = 4096


def model_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be the served model name, else None: empty or spaces alone (every
    response would say ``"model": ""``), a control character or a separator other than a
    space (no client could send it back), a space at either end (a quoting slip, ``'
    qwen3'``: every client sending ``"qwen3"`` was answered 404 ``model_not_found`` until
    stop 71), longer than :data:`MAX_MODEL_NAME` (a file's text given as the name)."""
    if not name.strip():
        return "must not be empty"
    if not name.isprintable():  # (a newline or a tab: no client could send it back)
        return "must be printable (no control characters, no separator other than a space)"
    if name != name.strip():
        return (f"begins or ends with a space: clients send {name.strip()!r} and would be "
                "answered 404 model_not_found; give the name without them")
    if len(name) > MAX_MODEL_NAME:
        return (f"{len(name)} characters, at most {MAX_MODEL_NAME} (every response and "
                "metric series names it)")
    return None


def _model_name(instance: Any, attribute: Any, value: Any) -> None:
    """A str :func:`model_name_problem` takes: every response and ``/v1/models`` names it
    (``--served-model-name`` is refused the same way)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"model_name={value!r}: must be a non-empty str")
    problem = model_name_problem(value)
    if problem is not None:
        raise ValueError(f"model_name={shown_name(value)}: {problem}")


def shown_name(name: str) -> str:
    """``name`` as a refusal shows it: repr, cut to its first 200 characters."""
    return repr(name[:200]) + ("..." if len(name) > 200 else "")


#: the largest ``ServerConfig.max_choices`` (``serve --max-choices``): the choices of one
#: request are set up together, each an admission, a task and a held answer, before the
#: first runs; OpenAI's own cap on ``n`` is 128
MAX_CHOICES = 1024
#: ``ServerConfig.max_choices``'s default: OpenAI's own cap on ``n``. It was 16 until stop 71,
#: below the 20 prompts LangChain's ``OpenAI`` LLM sends per request (its ``batch_size``):
#: ``llm.batch`` of 17 or more prompts was a 400
DEFAULT_MAX_CHOICES = 128
#: how many ``x-request-id`` s a line cutting requests names (``wire.cut_ids``)
CUT_IDS_LOGGED = wire.CUT_IDS_LOGGED


def _count(low: int) -> Callable[[Any, Any, Any], None]:
    """attrs validator of a count setting: an int >= ``low``, never a bool (``True`` was
    taken as 1 sequence) nor a float (2.5 worker threads)."""
    return fields.number(low, integral=True)


def _path_or_none(value: Any) -> str | None:
    """``tokenizer_path`` converter: a ``pathlib.Path`` becomes its str; None stays None."""
    if value is None or isinstance(value, str):
        return value
    path = os.fspath(value) if isinstance(value, os.PathLike) else None
    if isinstance(path, str):
        return path
    raise TypeError(f"tokenizer_path={value!r}: expected a str path or None, got "
                    f"{type(value).__name__}")


def _token_id(instance: Any, attribute: Any, value: Any) -> None:
    """A token id: an int >= 0 (not a bool). A str reached every decode stream as a stop
    token and failed every request with a 500."""
    if not fields.is_token_id(value):
        raise ValueError(f"{attribute.name}={value!r}: must be a token id (an int >= 0)")


def _origins(value: Any) -> tuple[str, ...]:
    """``cors_origins`` converter: any iterable of origins, but not one str (whose characters
    would be taken as origins, each refused as ``'h'``)."""
    if isinstance(value, str):
        raise TypeError(f"cors_origins={value[:100]!r}: expected a tuple of origins, not one "
                        f"str: write ({value[:100]!r},)")
    return tuple(value)


@attrs.frozen
class ServerConfig:
    """Operational settings of the server (the model's limits come from the executor)."""

    #: admin bearer token; None disables the admin endpoints (always 403). Printable ASCII
    #: without outer whitespace, as ``api_key`` (else no request could match it)
    admin_token: str | None = attrs.field(default=None, validator=_check_api_key)
    model_name: str = attrs.field(default="calexec-qwen3-synthetic", validator=_model_name)
    #: OpenAI endpoints need ``Authorization: Bearer <api_key>`` when set (docs/server.md)
    api_key: str | None = attrs.field(default=None, validator=_check_api_key)
    #: browser origins allowed to call the server (CORS: preflights answered, responses
    #: marked); empty: CORS off (docs/server.md)
    cors_origins: tuple[str, ...] = attrs.field(default=(), converter=_origins,
                                                validator=_check_cors)
    #: a Hugging Face tokenizer.json (or its directory); None: the byte-level tokenizer
    tokenizer_path: str | None = attrs.field(default=None, converter=_path_or_none)
    #: completion request body limit (413 above it).
    max_body_bytes: int = attrs.field(default=1 << 20, validator=_count(1))
    #: the whole request body must arrive within this many seconds of the route's first read
    #: of it (408 ``request.body_timeout`` and the connection closed otherwise): a client
    #: sending its body slowly (slowloris) holds its connection no longer
    body_timeout_s: float = attrs.field(default=30.0, validator=_seconds())
    #: per-request deadline when the body gives no ``timeout``; and the largest one accepted.
    default_timeout_s: float = attrs.field(default=30.0, validator=_seconds())
    max_timeout_s: float = attrs.field(default=600.0, validator=_seconds())
    #: KV sequence ids the server leases to requests: 1..max_sequences (0 is the golden run's).
    max_sequences: int = attrs.field(default=32, validator=_count(1))
    #: worker threads for blocking executor calls: this many for prefills (which may wait for
    #: KV or a slot) and as many again for the decodes and waits of running requests.
    worker_threads: int = attrs.field(default=16, validator=_count(1))
    #: Retry-After seconds on 429 and 503.
    retry_after_s: int = attrs.field(default=1, validator=_count(0))
    #: the token that ends a generation (a token id; the tokenizer's eos for ``calexec serve``)
    end_token_id: int = attrs.field(default=byte_tokenizer.END_TOKEN_ID, validator=_token_id)
    #: one bounded wait (s) of the background release of a sequence id for its last job to
    #: end / the device to let go; repeated until the executor is Stopped or Failed.
    release_wait_s: float = attrs.field(default=60.0, validator=_seconds())
    #: a response (or a stream's last event) is sent at most this long after the request's
    #: deadline, hung device or not (docs/server.md).
    deadline_slack_s: float = attrs.field(default=0.5, validator=_seconds())
    #: ``/admin/drain?grace=`` is refused above this (seconds).
    max_drain_grace_s: float = attrs.field(default=3600.0, validator=_seconds())
    #: the grace (s) of a ``POST /admin/drain`` without ``?grace=``: ``calexec serve``'s
    #: ``--grace``, the grace its signals drain with (``/admin/drain`` took 30 s whatever
    #: ``--grace`` said)
    drain_grace_s: float = attrs.field(default=30.0, validator=_seconds(positive=False))
    #: an operator call (``CompletionService.operator_call``: a reload's calbin check or model
    #: switch, a job page's drawing) waits at most this long (s) for one of the
    #: ``OPERATOR_THREADS`` to be free, then is answered 429 ``operator.busy`` naming the calls
    #: that hold them, with ``Retry-After`` (until stop 72 it waited without a bound: a job
    #: page behind a model switch waited for the switch, up to its golden's timeouts); 0:
    #: refused at once when both are busy
    operator_wait_s: float = attrs.field(default=10.0, validator=_seconds(positive=False))
    #: ``/admin/reload`` refuses a calbin larger than this (bytes).
    max_calbin_bytes: int = attrs.field(default=16 << 30, validator=_count(1))
    #: requests that may wait (within their deadline) for a KV sequence id or for the
    #: lifecycle to be Ready again; one more is refused (429 ids / 503 recovery), 0 never waits.
    #: Deep enough that a burst is queued, not refused (vLLM queues without a bound): a waiter
    #: is a suspended task and a few hundred bytes, no thread; each still waits no longer
    #: than its own deadline
    max_waiting: int = attrs.field(default=1024, validator=_count(0))
    #: the waiting queue re-reads the executor's lifecycle in slices this long (the executor
    #: has no state-change event; a freed sequence id wakes the queue at once)
    lifecycle_poll_s: float = attrs.field(default=0.005, validator=_seconds())
    #: resumes of one generation after retryable/device failures (drivers/serving/resume.py); 0: none
    max_resumes: int = attrs.field(default=3, validator=_count(0))
    #: total time (s) one request may lose to resumes before it gets the failure instead
    resume_budget_s: float = attrs.field(default=10.0, validator=_seconds())
    #: decode through the executor's pre-armed decode stream (issue 17: job N+1 is admitted
    #: and prepared while N runs; a token only fires it); False: one ``enqueue`` per token
    prearm: bool = attrs.field(default=True, validator=fields.flag())
    #: ... but only while the device's decode steps wait at least this long on the device (ms,
    #: the median wait of the last 32 decode jobs; pre-armed until one is measured): a
    #: faster device ends a step before pre-arming could hide anything behind it, and arming
    #: costs the submitter's CPU (the server at zero latency and c=8: about 70 requests/s
    #: with plain decodes, 54 pre-armed; docs/benchmarks.md). Decided when a request opens its decode stream; the
    #: answers are the same either way. 0: always pre-arm (while ``prearm``)
    prearm_min_device_ms: float = attrs.field(default=0.5, validator=_seconds(positive=False))
    #: choices one request may ask for: prompts x ``n`` (completions; chat: ``n``); above it
    #: the request is refused with a 400 naming ``n`` (or ``prompt``) and this cap. At most
    #: :data:`MAX_CHOICES`: a request's choices are set up together (one admission, task and
    #: answer each), so a cap of 10**11 let one request with a huge ``n`` take every byte
    max_choices: int = attrs.field(default=DEFAULT_MAX_CHOICES,
                                   validator=fields.number(1, MAX_CHOICES, integral=True))
    #: greedy requests: the executor's completion thread fires each next decode step with the
    #: argmax itself (``decode_stream(greedy_ahead=True)``), so the device does not wait for
    #: the event loop; a request ended by a stop string costs at most one discarded step
    greedy_ahead: bool = attrs.field(default=True, validator=fields.flag())
    #: wait for a job on the event loop (``CompletionHandle.wait_async``: the thread that
    #: resolves it wakes the loop) and take a decode step there when the stream has it ready
    #: (``DecodeSteps.submit_nowait``: fired ahead or pre-armed), instead of a worker thread
    #: per enqueue and per wait (issue 28: two fewer thread hand-offs per token). False: every
    #: enqueue and wait in a worker thread, the path before; the answers are the same
    #: (tests/test_server_inline_waits.py)
    inline_waits: bool = attrs.field(default=True, validator=fields.flag())
    #: a non-streamed greedy request without stop strings, log-probabilities or a grammar
    #: (nothing read per token) takes its jobs in one worker-thread burst: the thread runs its
    #: prefill and decode steps one after the other, as the plain path runs them, until the
    #: generation ends or a job fails, and the event loop wakes once for all of them instead
    #: of once per token (issue 28). A failed job is handed back to the loop and handled as
    #: the plain path handles it (resume, error). False: one loop wake per token; the answers
    #: are the same (tests/test_server_inline_waits.py)
    decode_bursts: bool = attrs.field(default=True, validator=fields.flag())
    #: the same for a streamed request's decode steps (server-sent events; its prefill, the
    #: first token, takes the plain path): its burst runs in the background
    #: and hands each token to the loop as it is taken; the loop is woken only when it waits
    #: for one (tokens taken while it was sending are handed out without a wake-up), so it
    #: no longer takes a worker thread's round trip and a wait per token. A failed job, a
    #: deadline or a disconnect is handled as the non-streamed burst handles it. False: one
    #: loop round trip per token; the answers and events are the same
    #: (tests/test_server_inline_waits.py)
    stream_bursts: bool = attrs.field(default=True, validator=fields.flag())
    #: "vllm": ``/metrics`` exports vLLM's ``vllm:`` families beside the ``calexec_`` ones
    #: (dashboards and autoscalers built for vLLM read them); "calexec": those only
    metrics_names: str = attrs.field(default="calexec",
                                     validator=attrs.validators.in_(METRICS_NAMES))

    def __attrs_post_init__(self) -> None:
        if self.default_timeout_s > self.max_timeout_s:  # every request without one refused
            raise ValueError(f"default_timeout_s={self.default_timeout_s!r} > max_timeout_s="
                             f"{self.max_timeout_s!r}: every request without its own timeout "
                             "would be refused")


@attrs.define
class Admission:
    """What ``CompletionService.admit`` reads of a request: its prompt (token ids, or text the
    server's tokenizer encodes), ``max_tokens``, ``sse`` (the answer goes out as server-sent
    events: the OpenAI body's ``stream``) and ``timeout`` (calexec's per-request deadline in seconds; None: the server's
    default). drivers/serving/openai_api.py builds it from the OpenAI bodies, where every
    parameter is implemented or refused."""

    prompt: str | list[int]
    max_tokens: int
    sse: bool = False
    timeout: float | None = None
    #: the log-probabilities of every prompt token after the first are computed (with this
    #: many most likely tokens each): completions' ``echo`` with ``logprobs``, vLLM's
    #: ``prompt_logprobs``. None: only the last prompt position's row is (one prefill)
    prompt_logprobs: int | None = None
    #: the request's ``n`` on the first choice of each prompt (vLLM's ``request_params_n``
    #: counts it once per prompt); None on the other choices
    n_param: int | None = 1
    #: the body's field a refusal of the prompt names (chat: ``messages``, whose rendering
    #: the prompt is; the chat body has no ``prompt``)
    prompt_param: str = "prompt"
    #: the body's field ``max_tokens`` came from (chat: ``max_completion_tokens`` when the body
    #: gave that one), named when it does not fit the context
    max_tokens_param: str = "max_tokens"
    #: the absolute deadline (``time.monotonic()``) of the request this run is a choice of
    #: (its choices share it); None: ``timeout`` from admission
    deadline: float | None = None


class SequencePool:
    """The server's KV sequence ids (it owns them, above every generation's KvManager): each
    id is free, in use (leased to a request, until its release on the executor succeeded) or
    withheld (its release failed for good: never reused). Invariant, checked by
    :meth:`consistent` and exported as metrics: free + in use + withheld = capacity.
    Thread-safe."""

    def __init__(self, ids: range) -> None:
        self._free = list(reversed(ids))
        self.size = len(ids)
        self._in_use: set[int] = set()
        self._withheld: set[int] = set()
        self._mu = threading.Lock()
        self.on_free: Callable[[], None] | None = None  # called (any thread) after a release

    def acquire(self) -> int | None:
        with self._mu:
            if not self._free:
                return None
            seq_id = self._free.pop()
            self._in_use.add(seq_id)
            return seq_id

    def release(self, seq_id: int) -> None:
        with self._mu:
            if seq_id not in self._in_use:
                raise ValueError(f"sequence {seq_id} is not in use")
            self._in_use.discard(seq_id)
            self._free.append(seq_id)
        if self.on_free is not None:
            self.on_free()

    def withhold(self, seq_id: int) -> None:
        """A sequence could not be released on the device: keep it out of circulation."""
        with self._mu:
            self._in_use.discard(seq_id)
            self._withheld.add(seq_id)

    def counts(self) -> dict[str, int]:
        with self._mu:
            return {"free": len(self._free), "in_use": len(self._in_use),
                    "withheld": len(self._withheld), "capacity": self.size}

    def consistent(self) -> bool:
        """free + in use + withheld = capacity, and no id is in two of them."""
        with self._mu:
            free = set(self._free)
            return (len(free) == len(self._free)
                    and len(free) + len(self._in_use) + len(self._withheld) == self.size
                    and not free & self._in_use and not free & self._withheld
                    and not self._in_use & self._withheld)

    @property
    def in_use(self) -> int:
        with self._mu:
            return len(self._in_use)

    @property
    def withheld(self) -> int:
        with self._mu:
            return len(self._withheld)

    leaked = withheld  # the older name


@attrs.define(eq=False)
class RequestRun:
    """One completion request in progress."""

    request_id: int
    seq_id: int | None  # None while waiting for one (admission, resume)
    prompt: list[int]
    max_tokens: int
    deadline: float  # absolute time.monotonic()
    started: float
    sse: bool  # the answer goes out as server-sent events
    logits: np.ndarray
    #: the generated tokens, the end or stop token that ended the generation included (last;
    #: ``stop_token``): counted and listed as vLLM counts them, its text not written
    tokens: list[int] = attrs.Factory(list)
    #: the end token or ``stop_token_ids`` id that ended the generation (None: another end)
    stop_token: int | None = None
    #: vLLM's ``stop_reason`` of the choice: the ``stop`` string or the ``stop_token_ids`` id
    #: that ended it; None when it ended another way (the end token, ``max_tokens``, the
    #: grammar)
    stop_reason: int | str | None = None
    past: int = 0
    handle: Any = None  # JobHandle of the current/last job
    abandoned: bool = False  # the client went away: cancel whatever job is or becomes current
    finish_reason: str | None = None
    status: Status | None = None
    first_token_at: float | None = None
    #: when it got its first sequence id (out of the waiting queue) and its latest token
    #: (``time.monotonic()``; the ``vllm:`` phase histograms)
    scheduled_at: float | None = None
    first_token_host: float | None = None
    last_token_at: float | None = None
    n_param: int | None = 1
    #: the request's timeout in seconds (the body's, or the server's default): a deadline
    #: error names it (None: the run's own, ``deadline - started``)
    timeout: float | None = None
    #: ``Admission.max_tokens_param``: the body's field a refusal of ``max_tokens`` names
    max_tokens_param: str = "max_tokens"
    #: the ``x-request-id`` its response carries (the route sets it; its dump record names it)
    x_request_id: str | None = None
    #: its response body's ``id`` (``cmpl-``/``chatcmpl-``/``resp_``...: one for all the
    #: choices of a request; the route sets it): its dump record names it, so two requests
    #: that sent one ``X-Request-Id`` are told apart by what each client got
    response_id: str | None = None
    #: a draining replica handed it to a sibling (drivers/serving/handoff.py): it ends with a
    #: ``status`` but is no failure (the sibling counts how it ends), counted in neither
    #: ``calexec_request_success_total`` nor ``_failures_total``
    handed_off: bool = False
    #: model generation of the request's jobs (its KV lives in that generation's KvManager)
    generation_id: int | None = None
    #: how tokens are chosen (drivers/serving/sampling.py); logprobs of each token when asked for
    sampling: sampling.SamplingParams = sampling.GREEDY
    token_logprobs: list = attrs.Factory(list)
    #: ``Admission.prompt_logprobs``: None, or how many top tokens each prompt position keeps;
    #: then the prompt is fed one token per job (``next_request``) and ``prompt_rows[j]`` is
    #: the log-probability of ``prompt[j + 1]`` (its rank in ``prompt_ranks[j]``)
    prompt_top: int | None = None
    prompt_rows: list = attrs.Factory(list)
    prompt_ranks: list = attrs.Factory(list)
    #: the grammar's state (``sampling.grammar``: structured outputs, tools), started with
    #: the first token; it advances with each token and ends the generation when complete
    constraint: RowConstraint | None = None
    # Enqueue fence: ``closed`` once the request finished (no enqueue may start after it);
    # ``enqueue_idle`` is clear while an enqueue call runs in a worker thread.
    mu: threading.Lock = attrs.Factory(threading.Lock)
    closed: bool = False
    enqueue_idle: threading.Event = attrs.Factory(lambda: _set_event())
    # drivers/serving/admission.py, drivers/serving/resume.py
    waiter: Any = None  # Waiter / sequence id / refusal while seq_id is None
    reprefill: bool = False  # the next job re-prefills prompt + tokens on a fresh sequence
    resumes: int = 0
    #: resumes of a (re-)prefill the lifecycle refused before it ran (``Resumer.resume``: no
    #: resume spent), at most ``resume.REFUSED_PREFILLS_MAX``
    refused_prefills: int = 0
    resume_s: float = 0.0  # time lost to finished resumes
    resume_started: float | None = None  # the failure the running resume started at
    resume_failure: Status | None = None  # what the request ends with if the resume gives up
    resume_cause: str | None = None  # calexec_resumes_total's cause of the last resume
    #: the executor's DecodeStream of the current sequence (``ServerConfig.prearm``); closed
    #: (its pre-armed job released) before the sequence is released
    decode: Any = None
    #: ``CompletionService.finish`` ran (it runs once: a cut response and the end of its body
    #: iterator may both ask for it)
    finished: bool = False
    #: what it held on the device (its job, decode stream, sequence id) was given back: by
    #: ``finish``, or earlier by ``generation_ended`` (a stream whose generation ended gives
    #: it back before its last bytes go out: a client slow to read them holds none of it)
    given_back: bool = False
    #: ``ServerConfig.decode_bursts``: the handler reads nothing per token (no stop strings,
    #: no fleet progress), so a greedy run may take its decode steps in a burst; the tokens a
    #: burst took and ``advance`` has not handed out yet; the failed step that ended a burst
    #: after it took tokens (handled once those are out); ``burst_cut``: the loop stopped
    #: waiting for the burst (deadline, disconnect): the thread commits nothing more
    bursts: bool = False
    burst: collections.deque = attrs.Factory(collections.deque)
    burst_failure: tuple[Any, Any] | None = None
    burst_cut: bool = False
    #: a streamed burst (``ServerConfig.stream_bursts``): the task that runs its thread
    #: (None: none running), and the future the loop waits on for its next token (set under
    #: ``mu`` by the loop, resolved by the thread when it takes one, or when the burst ends)
    burst_task: asyncio.Task | None = None
    burst_wake: asyncio.Future | None = None
    burst_loop: asyncio.AbstractEventLoop | None = None
    #: a streamed burst holds at most ``STREAM_AHEAD`` tokens the loop has not handed out:
    #: past that its thread waits (``burst_paused``) on ``burst_room`` (over ``mu``) until
    #: the loop has taken half of them, the request ended or its deadline came, so a client
    #: that stops reading stops the generation, as on the plain path
    burst_paused: bool = False
    burst_room: threading.Condition = attrs.field(init=False)
    #: an operator cancelled it (``POST /admin/cancel/{id}``, :meth:`CompletionService.cancel`):
    #: the ``request.aborted`` Status it ends with, whatever its job answers meanwhile
    cancelled: Status | None = None
    #: the cancel scope of the wait ``advance`` is in now (a sequence id's, anyio's; a job's or
    #: a burst's, the step's ``asyncio.timeout``), which a cancel cancels (expires: a timeout
    #: ``wire.expire``); None between two waits (the next ``advance`` sees ``cancelled``)
    scope: anyio.CancelScope | asyncio.Timeout | None = None
    #: a streamed answer's ``wire.SendCut`` (the route sets it): a cancel cuts its send to a
    #: client that stopped reading at once, not at the request's deadline + slack
    send_cut: wire.SendCut | None = None

    def __attrs_post_init__(self) -> None:
        self.burst_room = threading.Condition(self.mu)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.status is not None

    @property
    def rows_pending(self) -> bool:
        """Prompt positions whose row is still to be computed (``prompt_top``)."""
        return (self.prompt_top is not None and not self.tokens
                and len(self.prompt_rows) < len(self.prompt) - 1)

    def _prompt_in_next_job(self) -> int:
        """Prompt tokens the sequence's KV holds after the next job. Without prompt rows the
        whole prompt (one prefill); with them, one more than the rows computed: the row of
        a job whose KV ends at prompt[:k] is the distribution of prompt[k]. A re-prefill
        after a failure (a resume) thus redoes exactly what the failed job would have."""
        if self.prompt_top is None or self.tokens:  # (a continued generation: whole prompt)
            return len(self.prompt)
        return min(len(self.prompt_rows) + 1, len(self.prompt))

    def next_request(self) -> InferenceRequest:
        if self.seq_id is None:  # callers lease the sequence first
            raise TypeError(f"request {self.request_id}: next_request before a sequence id")
        if self.handle is None or self.reprefill:
            ids = np.asarray(self.prompt[:self._prompt_in_next_job()] + self.tokens,
                             dtype=np.int32)
            return InferenceRequest(seq_id=self.seq_id, kind=TaskKind.PREFILL_IDS, tokens=ids,
                                    positions=np.arange(len(ids), dtype=np.int32), past_len=0,
                                    deadline=self.deadline, request_id=self.request_id,
                                    kv_reserve_len=len(self.prompt) + self.max_tokens)
        # a prompt fed one token per job (prompt rows): the next prompt token, as a decode
        # step of the plain path (its KV is reserved: the first prefill reserved it all)
        feed = self.tokens[-1:] if self.past >= len(self.prompt) else [self.prompt[self.past]]
        return InferenceRequest(seq_id=self.seq_id, kind=TaskKind.DECODE,
                                tokens=np.asarray(feed, dtype=np.int32),
                                positions=np.asarray([self.past], dtype=np.int32),
                                past_len=self.past, deadline=self.deadline,
                                request_id=self.request_id)


class WindowMedian:
    """The median of the last ``size`` values added, as ``statistics.median`` of the finite
    ones among them (None while there is none), kept sorted as they come: reading it sorts
    nothing. ``CompletionService.decode_device_ms`` reads it once per decode job while no
    decode stream is open (every job of a fast device's burst), where copying, filtering
    and sorting the window took about as long as the job's other bookkeeping (stop 67,
    issue 28; ``tests/test_window_median.py`` against the plain computation). Any thread
    may add and read (one lock). An infinite or NaN value (no device wait is either: it is
    the difference of two clock readings) takes its place in the window but is no
    candidate for the median."""

    __slots__ = ("_window", "_sorted", "_lock")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"WindowMedian: size={size}: must be >= 1")
        self._window: collections.deque[float] = collections.deque(maxlen=size)
        self._sorted: list[float] = []  # the window's finite values, ascending
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        finite = math.isfinite(value)
        with self._lock:
            window = self._window
            if len(window) == window.maxlen:
                old = window[0]
                if math.isfinite(old):
                    del self._sorted[bisect.bisect_left(self._sorted, old)]
            window.append(value)
            if finite:
                bisect.insort(self._sorted, value)

    def median(self) -> float | None:
        with self._lock:
            values = self._sorted
            n = len(values)
            if not n:
                return None
            half = n // 2
            return values[half] if n % 2 else (values[half - 1] + values[half]) / 2


#: ``CompletionService._step``'s answer for a job whose row was a prompt position's
_PROMPT_ROW = object()
#: decode jobs whose device wait ``CompletionService.decode_device_ms`` takes the median of
_DEVICE_WINDOW = 32
#: ``CompletionService._step``'s answer when a decode burst took tokens (``run.burst``)
_BURST = object()
#: the tokens a streamed burst may take ahead of the loop handing them out
#: (``RequestRun.burst_room``)
STREAM_AHEAD = 16


#: how :func:`_told_as_timeout` starts a message (it rewrites a message once)
_TIMEOUT_TOLD = "request timeout="


#: codes of a run's failure about the body's maximum of tokens: the error's ``param`` (and the
#: field its message names, "max_tokens" in the layers below) is the field the body gave
#: (``RequestRun.max_tokens_param``: a chat's ``max_completion_tokens``)
MAX_TOKENS_CODES = frozenset({"kv.exceeds_capacity"})


#: a generation whose constraints left no token to choose (sampling.NoTokenLeft): 400
NO_TOKEN_LEFT = "sampling.no_token_left"
#: the code of a request an operator cancelled (``POST /admin/cancel/{id}``): answered 409
#: with ``x-should-retry: false`` (error_bodies.HTTP_OF_CODE; docs/server.md "Cancel")
ABORTED = "request.aborted"


def aborted(ident: str, seq_id: int | None = None) -> Status:
    """The failure of a request an operator cancelled by ``ident`` (its response id or
    ``x-request-id``): CANCELLED (never resumed, never retried), code :data:`ABORTED`."""
    return Status.failure(ABORTED, Category.CANCELLED, Phase.CANCEL,
                          f"request {fields.shown(ident, 128)} cancelled by the server's "
                          "operator (POST /admin/cancel); not retried", seq_id=seq_id)


#: the ASGI scope key of a request's arrival entry (``CompletionService.arriving``)
ARRIVAL = "calexec.arrival"


@attrs.define(eq=False)
class OpenRequest:
    """A request of several choices in progress (``CompletionService.open_request``): its
    ids, so that a cancel finds it also between one choice's end and the next one's
    admission, when it holds no run; ``cancelled`` once one did (its later choices are not
    admitted)."""

    response_id: str | None = None
    x_request_id: str | None = None
    cancelled: Status | None = None


@attrs.frozen
class CancelOutcome:
    """What :meth:`CompletionService.cancel` did: ``outcome`` ``cancelled`` (told now),
    ``repeated`` (told before, still ending), ``not_found`` (no request in progress has that
    id, or it already ended) or ``ambiguous`` (the id names several requests: none told);
    ``response_ids`` the requests the id names, ``choices`` the runs told."""

    outcome: str
    response_ids: tuple[str, ...] = ()
    x_request_id: str | None = None
    choices: int = 0


#: (``KNOCK_ON_CODE``, from drivers/serving/resume.py: the code of a failure that only says the
#: device stopped serving the request's generation (``Status.unavailable``): admission stopped
#: or the generation replaced by a recovery, a model switch or a drain, :func:`knock_on`)


def knock_on(status: Status) -> bool:
    """``status`` is a knock-on of something else (a recovery that another job's fault set
    off, a model switch, a drain), not the failure of a job of its own: ``lifecycle.unavailable``.
    A job's own failure (a device fault, NaN output, its hang) is the answer where both
    describe the same request (``CompletionService._failed``; a request of several choices,
    docs/server.md "A failed choice")."""
    return status.code == KNOCK_ON_CODE


def failure_param(run: RequestRun) -> str | None:
    """The body field ``run``'s failure is about (an error body's ``param``), if known."""
    if run.status is not None and run.status.code in MAX_TOKENS_CODES:
        return run.max_tokens_param
    if run.status is not None and run.status.code == NO_TOKEN_LEFT:
        return "allowed_token_ids"
    return None


def _as_told(run: RequestRun, status: Status) -> Status:
    """``status`` naming the field the body gave its maximum in, where it names max_tokens."""
    field = run.max_tokens_param
    if status.code not in MAX_TOKENS_CODES or field == "max_tokens":
        return status
    return attrs.evolve(status, message=re.sub(r"\bmax_tokens\b", field, status.message))


#: the executor's words for a wait that timed out on a job it leaves running
#: (``JobHandle.wait_until``: "...; the job continues (state Submitted)"), which the server
#: then cancels (``CompletionService._failed``)
_JOB_CONTINUES = re.compile(r"; the job continues(?: \(state [^)]*\))?")


def _told_as_timeout(run: RequestRun, status: Status) -> Status:
    """``status`` as the client reads it: a deadline that ended ``run`` is its ``timeout``
    (the body's, or the server's default), whichever step met it, and the request ended
    there (the server cancels the job it waited for); what to change follows, then the
    executor's words for that step ("queue deadline passed before infer()", ...) in
    parentheses, without the executor's "the job continues", which the server's cancel
    made untrue."""
    if status.category is not Category.DEADLINE or status.message.startswith(_TIMEOUT_TOLD):
        return status
    told = run.deadline - run.started if run.timeout is None else run.timeout
    step = _JOB_CONTINUES.sub("", status.message)
    if run.rows_pending:  # met while the prompt was scored one token a job: no max_tokens'
        scored = len(run.prompt_rows)  # fault (it said "a smaller max_tokens" until stop 71)
        return attrs.evolve(status, message=(
            f"{_TIMEOUT_TOLD}{told:g} s passed after {scored} of the prompt's "
            f"{len(run.prompt) - 1} logprobs positions, before any token was generated (the "
            "body's timeout, or the server's --timeout): prompt logprobs (echo with logprobs, "
            "or prompt_logprobs) score the prompt one token per device job; the request ended "
            f"there: give a larger timeout or a shorter prompt, or leave prompt logprobs out "
            f"({step})"))
    return attrs.evolve(status, message=(
        f"{_TIMEOUT_TOLD}{told:g} s passed after {len(run.tokens)} generated tokens (the "
        f"body's timeout, or the server's --timeout); the request ended there: give a larger "
        f"timeout or a smaller {run.max_tokens_param} ({step})"))


def _started(structure: GrammarSpec, tokens: list[int]) -> RowConstraint:
    """The constraint of ``structure`` (a ``grammar.Structure``), having accepted ``tokens`` (a
    generation continued from another replica)."""
    constraint = structure.start()
    for earlier in tokens:
        constraint.accept(earlier)
    return constraint


def _prompt_row(logits: np.ndarray, token: int, top: int) -> tuple[sampling.TokenLogprobs, int]:
    """The log-probability of prompt ``token`` in ``logits`` (the raw FP32 row of the
    position before it), the ``top`` most likely tokens', and the token's rank (1: the most
    likely; vLLM's ``prompt_logprobs`` rank: 1 + the tokens strictly more likely)."""
    # sampling.token_logprobs' values without its float64 copy of the row (one per prompt
    # token here): exp in FP32, the sum and the log in float64
    peak = float(logits.max())
    lse = peak + math.log(float(np.exp(logits - np.float32(peak)).sum(dtype=np.float64)))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        top = min(top, logits.shape[0])
        ids = np.argpartition(-logits, top - 1)[:top]
        ids = ids[np.lexsort((ids, -logits[ids]))]  # most likely first, ties by id
        best = tuple((int(i), float(logits[i]) - lse) for i in ids)
    info = sampling.TokenLogprobs(token, float(logits[token]) - lse, best)
    return info, 1 + int(np.count_nonzero(logits > logits[token]))


def close_decode(run: Any, wait: bool = True) -> bool:
    """Close the decode stream of ``run`` (or of a resume's failed sequence), if any: its
    pre-armed job is released (not counted as a failure) and a step fired ahead that nobody
    takes is cancelled. ``wait``: also wait (bounded) for that step to end; without, return
    at once (a response never waits for it). True when no job of the stream is left (its
    sequence can be released now: ``DecodeStream.quiet``). Blocking but bounded (the stream
    waits at most 2 s for an arming in progress); call from a worker thread."""
    stream = getattr(run, "decode", None)
    if stream is None:
        return True
    stream.close(wait=wait)
    return stream.quiet


def _resolve(future: asyncio.Future) -> None:
    """(On its loop.) ``future`` done, unless it already is (cancelled with its waiter)."""
    if not future.done():
        future.set_result(None)


def _answer_threadsafe(loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Any],
                       outcome: object, exc: BaseException | None) -> None:
    """(Any thread.) ``answer`` gets ``outcome`` (or ``exc``) on its loop; nobody waits for it
    once the loop is closed (as ``CompletionHandle.as_future``)."""
    try:
        loop.call_soon_threadsafe(_settle_answer, answer, outcome, exc)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _settle_answer(answer: asyncio.Future[Any], outcome: object,
                   exc: BaseException | None) -> None:
    """(On its loop.) ``answer`` done, unless it already is (cancelled with its waiter). A
    ``StopIteration`` is answered as a ``RuntimeError`` from it, as anyio's ``to_thread`` and
    ``threads.WorkerPool`` answer it: an asyncio future refuses it (``TypeError`` in this
    callback, and the waiter never woke)."""
    if answer.done():
        return
    if isinstance(exc, StopIteration):
        error = RuntimeError("a decode burst raised StopIteration")
        error.__cause__ = exc
        exc = error
    if exc is not None:
        answer.set_exception(exc)
    else:
        answer.set_result(outcome)


def _answer_at_deadline(answer: asyncio.Future[Any], handed: list[Any]) -> None:
    """(On its loop, at the request's deadline.) A burst that handed its last job over and
    has not answered (the job is not resolved: on the device, it is not before its
    execution deadline) answers now with its outcome, for ``_take_last`` to look at the job
    (``wait.deadline``, as the burst's thread's ``wait_until`` answered at the deadline).
    Nothing handed yet: the burst's thread answers itself (its wait answers at the
    deadline; a job it hands after the deadline, at once)."""
    if handed and not answer.done():
        answer.set_result(handed[0])


@attrs.frozen
class OperatorBusy:
    """``CompletionService.operator_call``'s answer when it found every operator turn busy
    past ``ServerConfig.operator_wait_s``: the call was not run; ``status`` (429
    ``operator.busy``) names the calls holding the turns."""

    status: Status


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def system_fingerprint(version: str, calbin_sha256: str, tokenizer: str,
                       chat_template: str | None) -> str:
    """``fp_`` and 10 hex digits of the sha256 of what changes the answers of a server (OpenAI's
    ``system_fingerprint``: a client tells backend configurations apart by it): the calexec
    ``version``, the served calbin's ``calbin_sha256`` (the model), the ``tokenizer`` (its
    name: ``byte-level`` or the tokenizer.json path) and its ``chat_template``."""
    parts = (version, calbin_sha256, tokenizer, "" if chat_template is None else chat_template)
    return "fp_" + hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()[:10]


class CompletionService:
    """Completions, drain and live-job bookkeeping around one executor."""

    def __init__(self, executor: ServedExecutor, config: ServerConfig, dump: DumpSink | None
                 ) -> None:
        problem = sequence_ids_problem(executor, config.max_sequences)
        if problem is not None:  # a server setting, never a client's 400 later
            raise ValueError(f"max_sequences{problem}")
        self.executor = executor
        self.config = config
        self.dump = dump
        self.sequences = SequencePool(range(1, config.max_sequences + 1))
        #: the requests' logits rows, reused once nothing can write them (drivers/serving/rows.py)
        self.rows = RowPool(config.max_sequences)
        self.draining = False
        self.drain_status: Status | None = None
        #: the grace (s) of the drain ``start_drain`` started; None before one
        self.drain_grace: float | None = None
        #: the drain's grace is over: what still runs is cut and the executor shut down
        self.grace_over = False
        self.on_drained: list[Any] = []  # callables run once a drain has finished
        self.active = 0  # admitted completion requests not yet finished
        #: requests of several choices under way (``open_request``): between two of its
        #: choices such a request holds no run, and a drain still waits for it
        self._open_requests = 0
        #: the requests of several choices in progress (``open_request``), by ``id()``
        self._open: dict[int, OpenRequest] = {}
        #: the requests arrived and not yet admitted (reading their body, compiling their
        #: grammar: ``arriving``), by ``id()``: a cancel by their ids sticks (not counted by
        #: a drain: it refuses them at admission)
        self._arriving: dict[int, OpenRequest] = {}
        self._live: dict[int, RequestRun] = {}
        #: the streamed responses whose sends run now (``wire.SendCut``, by their response id
        #: and ``x-request-id``): a cancel finds one there once its generation ended (a
        #: request of several choices has no run left then), to cut a send waiting for a
        #: client that stopped reading
        self.streams: set[wire.SendCut] = set()
        self._ids = itertools.count(1)
        # Prefills (may wait for KV capacity or a slot) and the jobs of requests that already
        # hold their KV take threads from separate limiters: waiting prefills never starve
        # the running requests of threads (that would be hold and wait again).
        self._limiter = anyio.CapacityLimiter(config.worker_threads)
        self._admit_limiter = anyio.CapacityLimiter(config.worker_threads)
        # Decode-stream steps: a pre-armed job holds a buffer slot until its request's next
        # step fires it, and a step that finds nothing armed waits for a slot. Were both on
        # one bounded pool, every thread could wait for a slot held by armed jobs whose
        # requests wait for a thread to fire them. One thread per sequence id (each request
        # has at most one step outstanding) means a step never waits for a thread. A decode
        # burst (``decode_bursts``) is the one thread of a request holding a sequence id.
        self._stream_limiter = anyio.CapacityLimiter(config.max_sequences)
        # The threads of the decode bursts (``_run_burst``; a streamed one's since stop 66,
        # ``_stream_burst_thread``), handed a burst
        # directly: anyio's ``to_thread`` first took a turn of the event loop
        # (``checkpoint``) and its limiter another (a shielded one), two cancel scopes and
        # about 15-20 us of the loop's CPU a request on the c=1 path (issue 28, stop 65). At
        # most ``max_sequences`` bursts hold a sequence at once, as the limiter allowed;
        # twice as many threads leave room for bursts a cancel gave up while their job
        # ends (the limiter freed their token at once). Threads start when needed and end
        # with the service (the pool's own weak reference) or at the app's shutdown. The
        # pool's own keeper thread starts them: the loop never waits for a thread to start
        # (``threads.WorkerPool``; stop 70).
        self._burst_threads = WorkerPool(2 * config.max_sequences, "calexec-burst")
        self._drain_task: asyncio.Task | None = None
        #: bounds every send of a streamed response (wire.BoundedStreamingResponse); a drain
        #: cuts the ones still waiting when its grace is over
        self.sends = wire.SendBounds()
        #: the request bodies being read (``wire.body_or_refusal``); a drain cuts them when
        #: its grace is over: the draining 503, not uvicorn's plain-text 500 at its exit
        self.bodies = wire.BodyReads()
        #: choices of streamed requests of several choices whose next chunk waits for room
        #: (the request's queue of ``STREAM_AHEAD`` chunks a choice is full: its client reads
        #: slower than they generate): ``calexec_stream_choices_waiting``. Event-loop only
        self.stream_choices_waiting = 0
        self._bursts_waiting = 0  # (stream_bursts_waiting; burst threads, under the lock)
        self._bursts_waiting_mu = threading.Lock()
        # background sequence releases (``release_later``): one thread each while it waits
        # for the run's last job, at most one per sequence id; started by the pool's keeper,
        # never by the loop that asks for them
        self._releases = WorkerPool(2 * config.max_sequences, "calexec-seq-release")
        # the blocking calls of a request's steps (``in_worker``: enqueue, waits, a sampled
        # pick, a grammar's start, a prompt row) under the limiters above, as anyio's
        # ``to_thread`` ran them until stop 70, which started its threads on the loop (and
        # again after 10 s idle): twice the limiters' tokens leave room for calls a cancel
        # gave up while they end (their token freed at once, as anyio's)
        # (and the operator's calls: ``operator_call``, at most OPERATOR_THREADS at once)
        self._workers = WorkerPool(2 * (2 * config.worker_threads + config.max_sequences
                                        + OPERATOR_THREADS), "calexec-worker")
        self._operator_limiter = anyio.CapacityLimiter(OPERATOR_THREADS)
        #: what each operator call holding a token of ``_operator_limiter`` does (event loop)
        self._operator_calls: list[str] = []
        self._releasing = 0  # asked for and not ended (``releases_pending``)
        self._releasing_mu = threading.Lock()
        self.metrics = ServerMetrics(self._metrics_snapshot, self._server_gauges, config.model_name,
                                     config.metrics_names, self._cache_info,
                                     None if dump is None else dump.counts)
        self.tokenizer = hf_tokenizer.load(config.tokenizer_path)
        self.started_at = time.time()
        self.admission = AdmissionQueue(self.sequences, lambda: executor.state, self.health,
                                        lambda: self.draining, config.max_waiting,
                                        config.lifecycle_poll_s, lambda: executor.failure)
        self.sequences.on_free = self.admission.wake_threadsafe
        self.resumer = Resumer(self)
        #: the device wait (ms) of the last ``_DEVICE_WINDOW`` decode jobs, read when a
        #: request opens its decode stream (``ServerConfig.prearm_min_device_ms``); written
        #: by whichever thread observes a job
        self._device_waits = WindowMedian(_DEVICE_WINDOW)
        self._contracts = executor.generation  # validation while the generation is replaced
        #: (calbin sha256, its :func:`system_fingerprint`): hashed once per calbin served
        self._fingerprint: tuple[str, str] | None = None

    def _metrics_snapshot(self) -> dict[str, Any]:
        """``executor.snapshot()`` with its ``recoveries`` split: the executor counts a model
        switch (``/admin/reload``) as a recovery (the lifecycle runs the same drain and golden),
        which an alert on fault recoveries must not page for."""
        snap = dict(self.executor.snapshot())
        switches, recoveries = {"ok": 0, "failed": 0}, 0
        # (the counts of every record, the dropped older ones too: ``recoveries`` keeps the
        # newest, and a scrape walked all of them until stop 72; one copy: both counts agree)
        for (reason, ok), count in self.executor.recovery_totals.items():
            if reason == MODEL_SWITCH:
                switches["ok" if ok else "failed"] += count
            else:
                recoveries += count
        snap["recoveries"], snap["model_switches"] = recoveries, switches
        return snap

    def _server_gauges(self) -> dict[str, float]:
        counts = self.sequences.counts()
        waiting = self.admission.waiting
        return {"calexec_num_requests_running": self.active - waiting,
                "calexec_num_requests_waiting": waiting,
                "calexec_kv_sequences_in_use": counts["in_use"],
                "calexec_kv_sequences_free": counts["free"],
                "calexec_kv_sequences_withheld": counts["withheld"],
                "calexec_kv_sequences_capacity": counts["capacity"],
                "calexec_server_draining": 1.0 if self.draining else 0.0,
                "calexec_kv_cache_usage_perc": kv_usage_fraction(self.executor),
                "calexec_responses_send_waiting": self.sends.waiting,
                "calexec_stream_choices_waiting": self.stream_choices_waiting,
                "calexec_stream_bursts_waiting": self.stream_bursts_waiting}

    def _cache_info(self) -> dict[str, str]:
        """``vllm:cache_config_info``'s labels: the KV block size and capacity in blocks of the
        current generation ("" when there is none)."""
        kvc = getattr(self.executor, "kvc", None)
        size = getattr(getattr(kvc, "kv", None), "block_size", None)
        blocks = None if kvc is None else kvc.capacity_blocks()
        return {"block_size": "" if size is None else str(size),
                "num_gpu_blocks": "" if blocks is None else str(blocks),
                "max_num_seqs": str(self.config.max_sequences)}

    @property
    def contracts(self) -> ModelGeneration | None:
        """The contracts (vocabulary, context length) requests are checked against: the
        current generation's, or while a recovery or model switch has released it and not yet
        opened the next one, the last one served (a request then waits for Ready, checked as
        it will be served; None only before any generation)."""
        self._contracts = self.executor.generation or self._contracts
        return self._contracts

    @property
    def system_fingerprint(self) -> str | None:
        """OpenAI's ``system_fingerprint`` of the answers served now: :func:`system_fingerprint`
        of this calexec, the calbin of :attr:`contracts` and the tokenizer (None before any
        generation). It changes when ``/admin/reload`` switches to another calbin."""
        contracts = self.contracts
        if contracts is None:
            return None
        cached = self._fingerprint
        if cached is None or cached[0] != contracts.calbin_sha256:
            cached = self._fingerprint = (contracts.calbin_sha256, system_fingerprint(
                __version__, contracts.calbin_sha256, self.tokenizer.name,
                self.tokenizer.chat_template))
        return cached[1]

    def health(self) -> list[str]:
        """Why the executor cannot serve now (empty: it can): ``executor.health()``."""
        return list(getattr(self.executor, "health", lambda: [])())

    @property
    def ready(self) -> bool:
        return self.executor.state == "Ready" and not self.draining and not self.health()

    @property
    def releases_pending(self) -> int:
        """Sequence releases waiting in the background for a job to end."""
        with self._releasing_mu:
            return self._releasing

    def live_job_counts(self) -> dict[str, int]:
        """JobChart state -> number of live jobs held by the server's requests."""
        counts = dict.fromkeys(JOB.states, 0)
        for run in list(self._live.values()):
            if run.handle is not None:
                counts[run.handle.state] += 1
        return counts

    # ---- admission ------------------------------------------------------------------------------
    @property
    def choice_concurrency(self) -> int:
        """Choices of one request (prompts x ``n``) that run at once: half the sequence ids
        (at least one); the others wait for their turn inside the request, so one request
        never takes every sequence id or all the KV."""
        return max(1, self.config.max_sequences // 2)

    def check(self, body: Admission, admitted: bool = False
              ) -> tuple[list[int] | None, Status, str | None]:
        """``body``'s prompt ids when :meth:`admit` would take it (nothing is leased), or
        (None, failure, offending field): a request of several choices checks them all
        before the first one runs. ``admitted``: as :meth:`admit`'s."""
        if self.draining and not admitted:
            return None, Status.unavailable(Phase.ADMISSION, "server is draining"), None
        # while a recovery replaces the generation, requests are validated against the last one
        generation = self.contracts
        if generation is None:
            return None, self.admission.not_serving(self.executor.state), None
        vocab = generation.vocab_size
        max_seq = generation.submodels[TaskKind.DECODE].max_seq
        prompt = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
        if not prompt:
            return None, invalid("prompt is empty"), body.prompt_param
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < vocab), None)
        if bad is not None:
            return None, invalid(f"prompt[{bad}]={fields.shown(prompt[bad])} outside the vocabulary "
                                  f"[0, {vocab})"), body.prompt_param
        if len(prompt) > max_seq:  # phrased as OpenAI and vLLM do: clients look for it
            return None, context_exceeded(
                f"This model's maximum context length is {max_seq} tokens. However, your "
                f"request has {len(prompt)} input tokens. Please reduce the length of the "
                f"{PROMPT_WORDS.get(body.prompt_param, body.prompt_param)}."), body.prompt_param
        if len(prompt) + body.max_tokens > max_seq:
            field = body.max_tokens_param
            return None, context_exceeded(
                f"This model's maximum context length is {max_seq} tokens. However, you "
                f"requested {fields.shown(len(prompt) + body.max_tokens)} tokens "
                f"({len(prompt)} in the prompt, {field}={fields.shown(body.max_tokens)} for "
                f"the completion). Please reduce "
                f"the prompt or {field}."), field
        timeout = self.config.default_timeout_s if body.timeout is None else body.timeout
        if timeout > self.config.max_timeout_s:
            # the body's number written as JSON, cut (an integer of 500 digits was echoed
            # whole, 1e400 as Python's "inf")
            return None, invalid(f"timeout={fields.shown(timeout)} > max_timeout_s="
                                  f"{self.config.max_timeout_s:g}"), "timeout"
        return list(prompt), Status.OK, None

    def admit(self, body: Admission, admitted: bool = False
              ) -> tuple[RequestRun | None, Status, str | None]:
        """A RequestRun holding a sequence id or waiting for one (``run.waiter``: its first
        ``advance`` waits, drivers/serving/admission.py), or (None, failure, offending field).
        ``admitted``: a later choice of a request of several whose first choice was admitted:
        a drain started since does not refuse it (the drain lets admitted requests finish)."""
        prompt, status, param = self.check(body, admitted)
        if prompt is None:
            return None, status, param
        timeout = self.config.default_timeout_s if body.timeout is None else body.timeout
        generation = self._contracts
        if generation is None:  # (check found one)
            return None, self.admission.not_serving(self.executor.state), None
        vocab = generation.vocab_size
        # an id, a place in the waiting queue, or a refusal
        got = self.admission.try_admit(admitted=admitted)
        if isinstance(got, Status):
            return None, got, None
        now = time.monotonic()
        deadline = now + timeout if body.deadline is None else body.deadline
        run = RequestRun(next(self._ids), got if isinstance(got, int) else None, list(prompt),
                         body.max_tokens, deadline, now, body.sse,
                         self.rows.take(vocab),
                         waiter=None if isinstance(got, int) else got,
                         prompt_top=body.prompt_logprobs, n_param=body.n_param,
                         timeout=timeout, max_tokens_param=body.max_tokens_param)
        if isinstance(got, int):
            run.scheduled_at = now
        self.active += 1
        self._live[run.request_id] = run
        self.metrics.requests.labels("true" if body.sse else "false").inc()
        return run, Status.OK, None

    # ---- generation -----------------------------------------------------------------------------
    async def advance(self, run: RequestRun) -> int | None:
        """Run jobs up to the next token; the new token, or None when the generation has ended
        (``finish_reason`` or ``status`` then says why). A request that asked for its prompt's
        log-probabilities (``RequestRun.prompt_top``) first feeds its prompt one token per job
        (``_step`` records each row) before the first token. Tokens a decode burst took
        (``ServerConfig.decode_bursts``) are handed out one per call, in order."""
        while True:
            if run.cancelled is not None:  # an operator's cancel: no token more, even one
                run.status = run.cancelled  # a burst already took (its end: ``cancel``)
                return None
            # (no ``typing.cast`` here: a Python call for each token; issue 28, stop 75)
            if run.burst:
                with run.mu:  # (a streamed burst's thread may wait for room)
                    taken: int = run.burst.popleft()
                    if run.burst_paused and len(run.burst) <= STREAM_AHEAD // 2:
                        run.burst_room.notify()
                return taken
            token = await self._step(run)
            if token is not _PROMPT_ROW and token is not _BURST:
                if token is None and run.cancelled is not None:
                    run.status = run.cancelled
                elif token is None and run.status is not None:
                    run.status = _as_told(run, _told_as_timeout(run, run.status))
                return token  # type: ignore[return-value]  # (an int or None here)

    @staticmethod
    def token_ready(run: RequestRun) -> bool:
        """The next ``advance`` of ``run`` returns a token a burst already took, without
        waiting."""
        return bool(run.burst)

    async def _step(self, run: RequestRun) -> int | None | object:
        """Run one job: the new token, ``_PROMPT_ROW`` when the job's row was a prompt
        position's (recorded in ``run.prompt_rows``), ``_BURST`` when a decode burst took
        tokens (in ``run.burst``), or None at the end (``advance``)."""
        if run.burst_failure is not None:  # the step after a burst's tokens failed
            (result, handle), run.burst_failure = run.burst_failure, None
            return await self._failed(run, result, handle)
        if run.done:
            return None
        if run.max_tokens == 0 and not run.rows_pending:  # echo or prompt rows only
            run.finish_reason = "length"
            return None
        if run.seq_id is None:  # waiting for a sequence id and Ready (admission or resume)
            refused = None
            try:
                with anyio.CancelScope() as waiting:  # (an operator's cancel ends the wait)
                    run.scope = waiting
                    refused = await self.resumer.take_sequence(run)
            finally:  # (no exited scope is left for a later cancel to cancel)
                run.scope = None
            if waiting.cancelled_caught or run.cancelled is not None:
                # the wait left the queue and gave back an id it was handed (admission.wait)
                run.status = run.cancelled
                return None
            if refused is not None:
                run.status = refused
                return None
            if run.scheduled_at is None:
                run.scheduled_at = time.monotonic()
        moved = self._generation_moved(run)
        if moved is not None and run.burst_task is None:
            # (a streamed burst under way is waited for first, below: its tokens and its own
            # failed step are the request's before a replacement is; its step's fault, e.g. a
            # pre-armed step's refused CSR write, sets off the recovery that replaces the
            # generation, and taken for a replacement it was resumed past: a re-prefill, one
            # more token, then the fault, where the plain path answers the fault at once)
            # (past the drain's grace the shutdown ended the generation: nothing to resume)
            if not self.grace_over and await self.resumer.resume(run, moved, replaced=True):
                return await self.advance(run)  # bounded: resume.REFUSED_PREFILLS_MAX + max_resumes
            run.status = moved
            return None
        # The request deadline bounds everything below, thread limiters included: the
        # executor answers at the deadline itself (its own, more precise Status); a tenth of
        # the slack later the handler stops waiting anyway (504) and cancels the job, if any;
        # the rest of the slack is for the event loop to send the answer. The sequence is
        # released once the job ended (finish()).
        stop_at = run.deadline + self.config.deadline_slack_s / 10
        burst = self._burstable(run)
        got = None
        # (an ``asyncio.timeout``, not anyio's ``move_on_after``: 12 Python calls a step, not
        # 42, stop 74; nothing it bounds is shielded: ``_run_burst`` and ``_run_job`` wait
        # with ``abandon_on_cancel``, and a cancel reaching a limiter's shielded checkpoint
        # gives its token back, enqueueing nothing)
        bound = asyncio.timeout(max(0.0, stop_at - time.monotonic()))
        late = False
        try:
            async with bound:
                run.scope = bound  # (an operator's cancel expires it: ``cancel``)
                got = await self._run_burst(run) if burst else None
                if got is None:  # no burst, or it took no step: the plain path takes this one
                    got = await self._run_job(run)
        except TimeoutError:
            if not bound.expired():  # (not the bound's)
                raise
            late = True
        finally:
            run.scope = None
        if late or run.cancelled is not None:
            if run.handle is not None:
                run.handle.cancel()
            run.status = run.cancelled or Status.deadline(
                Phase.WAIT, "request deadline passed; the server stopped waiting",
                seq_id=run.seq_id)
            return None
        if got is _BURST:
            return _BURST
        result, handle = got  # type: ignore[misc]  # (a (result, handle) pair here)
        if isinstance(result, Status):
            return await self._failed(run, result, handle)
        if result.kv_len < len(run.prompt):  # a prompt position's row: the next prompt token's
            self._observe(run, result)
            row = await self.in_worker(_prompt_row, result.logits, run.prompt[run.past],
                                       run.prompt_top or 0, limiter=self._limiter)
            run.prompt_rows.append(row[0])
            run.prompt_ranks.append(row[1])
            return _PROMPT_ROW
        if run.sampling.plain_greedy:
            return self._accept(run, result)
        self._observe(run, result)
        if run.constraint is None and run.sampling.grammar is not None:
            # (a worker thread's: a large grammar's matcher takes half a second to build,
            # which on the loop stalled every other client; llguidance lets the GIL go)
            run.constraint = await self.in_worker(_started, run.sampling.grammar, run.tokens,
                                                  limiter=self._limiter)
        args = (result.logits, run.sampling, len(run.tokens), result.argmax, run.prompt,
                run.tokens, run.constraint)
        try:
            token, logprobs = await self.in_worker(sampling.pick, *args, limiter=self._limiter)
        except sampling.NoTokenLeft as err:  # the request's own constraints: a 400
            run.status = Status.failure(NO_TOKEN_LEFT, Category.INVALID_REQUEST, Phase.VALIDATE,
                                        str(err), seq_id=run.seq_id)
            return None
        return self._take(run, token, logprobs)

    async def _failed(self, run: RequestRun, result: Status, handle: Any) -> int | None:
        """A job of ``run`` failed: resume the request (re-prefill on a fresh sequence) when
        the failure allows it, else end it with the failure."""
        if handle is not None:
            handle.cancel()  # wait deadline: the job continues unless told otherwise
        if run.cancelled is not None:  # an operator's cancel, whatever the job answered
            run.status = run.cancelled
            return None
        if (self.draining and not (run.abandoned or run.finished) and (
                result.category is Category.CANCELLED
                or (self.grace_over and result.category is Category.UNAVAILABLE))):
            # the request cancelled nothing (its client is there): the executor's shutdown at
            # the end of the drain's grace cancelled its queued or pre-armed step, or refused
            # its next one ("lifecycle is Draining; not admitting", "generation 1 retired
            # while the job was armed"): the drain ended it, nothing to resume (a resume
            # was counted in calexec_resumes_total for each such request)
            run.status = self._drained(run)
            return None
        # The job's own failure in the request's generation (a device fault, NaN output)
        # decides over a generation the recovery that fault set off retired meanwhile (on a
        # loop that took its time, the same fault answered either way: 503
        # lifecycle.unavailable or its own code); a knock-on (admission stopped, "retired
        # while the job was armed") or a job that met the next generation without the KV
        # (kv.past_len_beyond_committed) is told as the generation replaced, which it is
        own = (not knock_on(result) and result.generation is not None
               and result.generation == run.generation_id)
        moved = None if own else self._generation_moved(run, result)
        if not self.grace_over and await self.resumer.resume(run, moved or result,
                                                             replaced=moved is not None):
            return await self.advance(run)  # bounded: resume.REFUSED_PREFILLS_MAX + max_resumes
        run.status = moved or result
        return None

    def _observe(self, run: RequestRun, result: Any) -> None:
        """A job of ``run`` succeeded: the resume it ended (if any), its stage timings, the
        sequence's new length and the time to the first token."""
        if run.generation_id is None:
            run.generation_id = result.generation
        self.resumer.resumed(run)
        self.metrics.observe_job(result.kind, result.timings)
        if result.kind == TaskKind.DECODE:
            self._device_waits.add(result.timings.device_wait_ms)
        run.past = result.kv_len
        if run.first_token_at is None and run.past >= len(run.prompt):
            run.first_token_at = result.timings.completed_us / 1e6
            self.metrics.ttft.observe(max(0.0, run.first_token_at - run.started))

    def _accept(self, run: RequestRun, result: Any) -> int | None:
        """A plain greedy job's result taken: its argmax is the token (no thread, no row
        read). Runs on the loop, or on a burst's thread under ``run.mu``."""
        self._observe(run, result)
        args = (result.logits, run.sampling, len(run.tokens), result.argmax, run.prompt,
                run.tokens, run.constraint)
        token, logprobs = sampling.pick(*args)
        return self._take(run, token, logprobs)

    def _accept_plain(self, run: RequestRun, result: Any) -> int | None:
        """``_accept`` for a plain greedy run (every decode burst's run, ``_burstable``; its
        sampling parameters are fixed before its first job): the executor's argmax is the
        token, no log-probabilities, as ``sampling.pick`` returns them for plain greedy
        parameters, without ``pick``'s look at the parameters once per job (issue 28, stop
        68; the bursts against the plain path: ``tests/test_server_inline_waits.py``). Runs
        on a burst's thread under ``run.mu``."""
        self._observe(run, result)
        argmax = result.argmax
        token = int(np.argmax(result.logits)) if argmax is None else int(argmax)
        return self._take(run, token, None)

    def _take(self, run: RequestRun, token: int, logprobs: Any) -> int | None:
        """The chosen ``token`` of a job, appended: None when it ends the generation (the end
        token or a stop token id, ``run.stop_token``: generated, so counted in ``usage``,
        listed in ``token_ids`` and logprobs as vLLM does, but its text is not part of the
        answer), else the token; ``finish_reason`` set when the grammar is complete or
        ``max_tokens`` reached."""
        stop = (token == self.config.end_token_id and not run.sampling.ignore_eos) \
            or token in run.sampling.stop_token_ids
        run.tokens.append(token)
        if self.metrics.vllm is not None:
            now = time.monotonic()
            last = run.last_token_at
            self.metrics.vllm.token(last is None, len(run.prompt),
                                    now - (run.started if last is None else last))
            if last is None:
                run.first_token_host = now
            run.last_token_at = now
        if logprobs is not None:
            run.token_logprobs.append(logprobs)
        if stop:
            run.finish_reason = "stop"
            run.stop_token = token
            if token != self.config.end_token_id or run.sampling.ignore_eos:
                run.stop_reason = token  # a stop_token_ids id (the end token: None, as vLLM)
            return None
        if run.constraint is not None and run.constraint.finished:
            run.finish_reason = "stop"  # the grammar is complete: nothing may follow
        elif len(run.tokens) >= run.max_tokens:
            run.finish_reason = "length"
        return token

    # ---- decode bursts (ServerConfig.decode_bursts) ---------------------------------------------
    def _burstable(self, run: RequestRun) -> bool:
        """The run's next jobs may go in a burst: bursts on for its kind (``decode_bursts``,
        ``stream_bursts`` for a streamed run), the handler reads nothing per token that could
        end it early (``run.bursts``), plain greedy, no prompt rows, a sequence id held. A
        streamed run's burst starts after its prefill: the first token (time to first token)
        takes the plain path, with no burst to start before it."""
        if run.sse:
            on = self.config.stream_bursts and run.past >= len(run.prompt)
        else:
            on = self.config.decode_bursts
        return (on and run.bursts and run.sampling.plain_greedy and run.prompt_top is None
                and run.seq_id is not None)

    async def _run_burst(self, run: RequestRun) -> object:
        """Take ``run``'s jobs (its prefill, then its decode steps) in one worker thread
        (``_burst``): ``_BURST`` when it took any (tokens in ``run.burst``; a step that ended
        the generation with the end or a stop token counts; a failed step after them in
        ``run.burst_failure``), (failure, handle) when its first job failed, None when it took
        none (the plain path takes it). Cancelled (deadline, disconnect), the thread is told
        to stop and commits nothing more; it ends with its job, which the cancel ends.
        A streamed run's burst runs in the background (``_stream_burst``)."""
        if run.sse:
            return await self._stream_burst(run)
        try:
            steps, failure, last = await self._in_burst_thread(run, hand_last=True)
        except anyio.get_cancelled_exc_class():
            self._cut_burst(run)
            raise
        if last is not None:  # its result is here: taken as the burst's thread takes one
            steps, failure = self._take_last(run, last, steps)
        if not steps:
            return failure
        self.metrics.burst_jobs.inc(steps)
        if failure is not None:
            run.burst_failure = failure
        return _BURST

    def _in_burst_thread(self, run: RequestRun, hand_last: bool = False
                         ) -> Awaitable[tuple[int, tuple[Any, Any] | None, Any]]:
        """``_burst(run, hand_last)`` in a thread of ``_burst_threads``, in a copy of the
        caller's context (as anyio's ``to_thread`` ran it): (steps, failure, the last job's
        handle or None). The thread answers the loop through ``call_soon_threadsafe`` when it
        returns, or, when it handed the run's last job over (``hand_last``), the thread that
        resolves that job does, from its done callback (``_burst_answering``): the
        loop wakes once for the burst, not once for the job's thread and once more for the
        burst's (issue 28, stop 69). A handed job not resolved by the request's deadline is
        answered then by the loop's own timer (``_answer_at_deadline``), as the burst's
        thread's ``wait_until`` answered it (``wait.deadline``; a job on the device is not
        resolved at the request's deadline). Cancelled, the await ends at once and the
        thread goes on until it sees the cut (``_cut_burst``), as ``abandon_on_cancel`` did.
        Once the pool is shut down (the app stopped), anyio's thread, as before stop 65."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[tuple[int, tuple[Any, Any] | None, Any]] = loop.create_future()
        handed: list[tuple[int, tuple[Any, Any] | None, Any]] = []
        context = contextvars.copy_context()
        try:
            self._burst_threads.submit(context.run, self._burst_answering, run, hand_last,
                                       loop, answer, handed)
        except RuntimeError:  # (the pool is shut down: it takes no new work)
            return to_thread.run_sync(self._burst, run, abandon_on_cancel=True,
                                      limiter=self._stream_limiter)
        if hand_last:
            timer = loop.call_later(max(0.0, run.deadline - time.monotonic()),
                                    _answer_at_deadline, answer, handed)
            answer.add_done_callback(lambda _answer: timer.cancel())
        return answer

    def _burst_answering(self, run: RequestRun, hand_last: bool,
                         loop: asyncio.AbstractEventLoop,
                         answer: asyncio.Future[tuple[int, tuple[Any, Any] | None, Any]],
                         handed: list[tuple[int, tuple[Any, Any] | None, Any]]) -> None:
        """(A burst's thread.) ``_burst``, its outcome (or what it raised) given to the loop's
        ``answer``; a last job it handed over answers when resolved (its done callback),
        its done callback registered after the burst's enqueue fence was left, so the loop
        never finds the fence still held by a burst that answered. The outcome is in
        ``handed`` first, for the loop's timer at the request's deadline; once that passed
        (the timer may have found ``handed`` empty), the thread answers at once."""
        try:
            outcome = self._burst(run, hand_last)
        except BaseException as exc:
            _answer_threadsafe(loop, answer, None, exc)
            raise
        last = outcome[2]
        if last is not None:
            handed.append(outcome)
            if time.monotonic() < run.deadline:
                last.add_done_callback(
                    lambda _handle: _answer_threadsafe(loop, answer, outcome, None))
                return
        _answer_threadsafe(loop, answer, outcome, None)

    def _take_last(self, run: RequestRun, last: Any, steps: int
                   ) -> tuple[int, tuple[Any, Any] | None]:
        """(The loop.) The last job of a non-streamed burst (``_burst``'s ``hand_last``),
        resolved or its request's deadline passed: committed to ``run`` under ``run.mu``
        exactly as the burst's thread commits a result (unless the burst was cut), or its
        failure (the ``wait.deadline`` of a job still running, as the burst's thread's wait
        answered) returned as the burst's failed step. Returns (steps, failure) as ``_burst``
        would have. Never blocks: an unresolved job is only looked at."""
        result = last.wait_until(run.deadline if last.done
                                 else min(run.deadline, time.monotonic()))
        if isinstance(result, Status):
            return steps, (result, last)
        with run.mu:
            if run.closed or run.burst_cut:
                return steps, None
            token = self._accept_plain(run, result)
            steps += 1
            if token is not None:
                run.burst.append(token)
        return steps, None

    def close_burst_threads(self) -> None:
        """The app stopped: the idle burst, release and worker threads end (one still running
        ends first; a release asked for later runs in a thread of its own, a step's call in
        anyio's)."""
        self._burst_threads.shutdown()
        self._releases.shutdown()
        self._workers.shutdown()

    @staticmethod
    def _cut_burst(run: RequestRun) -> None:
        """The loop stopped waiting for ``run``'s burst (deadline, disconnect): its thread
        commits nothing more, and whatever job is or becomes current is cancelled (as
        ``_run_job`` does)."""
        with run.mu:
            run.burst_cut = True
            run.burst_wake = None
            run.burst_room.notify_all()
        run.abandoned = True
        handle = run.handle
        if handle is not None:
            handle.cancel()

    async def _stream_burst(self, run: RequestRun) -> object:
        """A streamed run's burst: started in the background on the first call (its thread
        runs ``_burst``); each call returns ``_BURST`` once a token is in ``run.burst`` (the
        loop sleeps only while none is), and once the burst ended with every token handed
        out, what ``_run_burst`` returns for a burst that took none: its failed job (handled
        as the plain path handles it) or None (the plain path takes the next job; a run the
        burst finished is done). Cancelled (deadline, disconnect), the burst is cut."""
        task = run.burst_task
        if task is None:
            loop = asyncio.get_running_loop()
            run.burst_loop = loop
            task = run.burst_task = loop.create_task(self._stream_burst_thread(run))
        try:
            while True:
                with run.mu:
                    if run.burst:
                        return _BURST
                    if task.done():
                        break
                    wake = run.burst_wake = task.get_loop().create_future()
                await wake
        except anyio.get_cancelled_exc_class():
            self._cut_burst(run)
            raise
        run.burst_task = None
        steps, failure = task.result()
        return failure if failure is not None or not steps else _BURST

    async def _stream_burst_thread(self, run: RequestRun) -> tuple[int, tuple[Any, Any] | None]:
        """The task of a streamed burst: its thread's (steps, failure), its jobs counted;
        wakes the loop when it ends. The thread is one of ``_burst_threads``, as a
        non-streamed burst's (stop 66: anyio's ``to_thread`` took a turn of the loop and its
        limiter a shielded one first, once a streamed request). Never raises (nothing awaits a cut burst's task): a
        failure of the thread itself ends the burst with none (the plain path takes the next
        job)."""
        try:
            steps, failure, _ = await self._in_burst_thread(run)  # (never hands over)
            self.metrics.burst_jobs.inc(steps)
            return steps, failure
        except Exception:  # noqa: BLE001 - logged; the plain path takes over
            log.exception("streamed decode burst of request %d", run.request_id)
            return 0, None
        finally:
            with run.mu:
                wake, run.burst_wake = run.burst_wake, None
            if wake is not None and not wake.done():
                wake.set_result(None)

    @staticmethod
    def _hand_token(run: RequestRun) -> None:
        """(Burst thread, ``run.mu`` held, a token just appended.) A streamed run's loop
        waiting for a token is woken; one busy elsewhere finds it in ``run.burst``."""
        wake, run.burst_wake = run.burst_wake, None
        if wake is not None and run.burst_loop is not None:
            run.burst_loop.call_soon_threadsafe(_resolve, wake)

    def _room(self, run: RequestRun) -> bool:
        """(Burst thread, ``run.mu`` held.) Wait while a streamed burst holds
        ``STREAM_AHEAD`` tokens the loop has not taken, until it took half of them: True;
        False when the request ended, the loop cut the burst or the deadline came first
        (the burst commits nothing more). A waiting burst is counted in
        :attr:`stream_bursts_waiting`."""
        if len(run.burst) < STREAM_AHEAD:
            return True
        run.burst_paused = True
        with self._bursts_waiting_mu:
            self._bursts_waiting += 1
        try:
            while len(run.burst) > STREAM_AHEAD // 2:
                if run.closed or run.burst_cut:
                    return False
                remaining = run.deadline - time.monotonic()
                if remaining <= 0:
                    return False
                run.burst_room.wait(remaining)
        finally:
            run.burst_paused = False
            with self._bursts_waiting_mu:
                self._bursts_waiting -= 1
        return not (run.closed or run.burst_cut)

    @property
    def stream_bursts_waiting(self) -> int:
        """Streamed decode bursts whose thread waits for room: ``STREAM_AHEAD`` tokens the
        loop has not sent wait before them (``calexec_stream_bursts_waiting``)."""
        return self._bursts_waiting

    def _burst(self, run: RequestRun, hand_last: bool = False
               ) -> tuple[int, tuple[Any, Any] | None, Any]:
        """Worker thread: run ``run``'s jobs one after the other as the plain path runs them
        (a prefill through ``enqueue``, a decode step through the decode stream, each token
        fed to the next) until the generation ends, a job fails, the generation moved or the
        loop cut the burst: (steps committed, the failed step's
        (Status, handle) or None, None). Inside the enqueue fence with ``finish``; each result
        is committed to ``run`` under ``run.mu`` unless the burst was cut. ``hand_last`` (a
        non-streamed run): the job whose token is the run's last (``max_tokens``), when
        ``enqueue`` takes it, is not waited for here: its handle comes back third, for the
        loop to take its result when resolved (``_in_burst_thread``, ``_take_last``), or at
        the request's deadline, which this thread's ``wait_until`` would have answered
        (``wait.deadline``: the executor resolves a job on the device by its execution
        deadline, not the request's)."""
        steps = 0
        with run.mu:
            if run.closed or run.burst_cut:
                return 0, None, None
            run.enqueue_idle.clear()
        try:
            while not (run.done or run.burst_cut) and self._generation_moved(run) is None:
                request = run.next_request()
                if self._streamed(run, request):  # as _run_job:
                    handle = self._stream_submit(run, request)  # through the decode stream
                    if isinstance(handle, Status):
                        return steps, (handle, None), None
                    result = run.decode.wait()
                else:  # a prefill (the first, a resume's re-prefill), as _run_job's enqueue
                    handle = self.executor.enqueue(request, run.logits,
                                                   on_created=lambda h: self._created(run, h))
                    if hand_last and len(run.tokens) + 1 >= run.max_tokens:
                        return steps, None, handle  # its token ends the run: the loop's
                    result = handle.wait_until(run.deadline)
                if isinstance(result, Status):
                    return steps, (result, handle), None
                with run.mu:
                    if run.closed or run.burst_cut:
                        break
                    token = self._accept_plain(run, result)
                    steps += 1
                    if token is not None:
                        run.burst.append(token)
                        # a streamed run's last token: the burst ends next, and its end
                        # wakes the loop (``_stream_burst_thread``), once for both (stop 69)
                        if run.sse and not run.done:
                            self._hand_token(run)
                            if not self._room(run):
                                break
            return steps, None, None
        finally:
            run.enqueue_idle.set()

    @staticmethod
    def _created(run: RequestRun, created: Any) -> None:
        """``enqueue``'s ``on_created`` for a job of ``run``."""
        run.handle = created  # reachable for a disconnect while admission still waits
        if run.abandoned:  # the client left before this job existed
            created.cancel()

    def _streamed(self, run: RequestRun, request: InferenceRequest) -> bool:
        """``request`` (the run's next job) goes through the run's decode stream: a decode of
        a generated token (not a prompt token fed for its row) with the stream open, or one
        that opens it (``ServerConfig.prearm`` on and the device slow enough to pre-arm
        for: ``prearm_min_device_ms``)."""
        if request.kind != TaskKind.DECODE or run.past < len(run.prompt):
            return False
        stream = run.decode
        if stream is not None and not stream.closed:
            return True
        config, device_ms = self.config, self.decode_device_ms
        return config.prearm and (device_ms is None
                                  or device_ms >= config.prearm_min_device_ms)

    @property
    def decode_device_ms(self) -> float | None:
        """The device's decode step time as the server sees it: the median device wait of the
        last ``_DEVICE_WINDOW`` decode jobs (ms; None: none yet). The median, not an average
        or the least: a wait is measured around ``Wait``, so a completion thread that comes
        late to it (busy with the job before) measures too little, and one that gets the GIL
        back late on a loaded host too much; a minority of either does not move the median.
        A host so loaded that most waits are late reads a fast device as slow and pre-arms,
        the path before this policy."""
        return self._device_waits.median()

    async def in_worker(self, fn: Callable[..., T], *args: Any,
                        limiter: anyio.CapacityLimiter | None = None,
                        abandon_on_cancel: bool = False) -> T:
        """(The event loop: the server's routes and its own steps.) ``fn(*args)`` in a thread
        of ``_workers``, in a copy of the caller's context, once ``limiter`` (if any) lends a
        token, as ``anyio.to_thread.run_sync(fn, *args, limiter=limiter,
        abandon_on_cancel=abandon_on_cancel)`` ran it until stop 70 (anyio started its worker
        threads on the event loop, ``Thread.start`` waiting for each to be scheduled): the
        token is held until the call returns, or until the await is cancelled when
        ``abandon_on_cancel`` (the call, if it started, runs on; one not started is
        dropped), else the cancel waits for the call's end. Once the app stopped (the pool
        takes no new work), anyio's thread."""
        async with limiter if limiter is not None else contextlib.nullcontext():
            context = contextvars.copy_context()
            try:
                future = self._workers.submit(context.run, fn, *args)
            except RuntimeError:  # (the app stopped)
                return await to_thread.run_sync(fn, *args, abandon_on_cancel=abandon_on_cancel)
            if abandon_on_cancel:
                return await asyncio.wrap_future(future)
            with anyio.CancelScope(shield=True):
                result = await asyncio.wrap_future(future)
            return result

    async def operator_call(self, what: str, fn: Callable[..., T], *args: Any
                            ) -> T | OperatorBusy:
        """(The event loop: an admin or debug route.) ``fn(*args)`` in a worker thread
        (``in_worker``), at most ``OPERATOR_THREADS`` such calls at once (a script asking for
        many job pages takes no thread a request's step needs), the await's cancel waiting
        for the call's end as anyio's ``to_thread`` did: a calbin check, a model switch, a
        job page's drawing; ``what`` says which, for the answer of a call that finds them
        busy. A call waits at most ``ServerConfig.operator_wait_s`` for its turn, then is not
        run: :class:`OperatorBusy`, whose status (429, ``Retry-After``) names the calls that
        hold the turns (until stop 72 the wait had no bound: a job page behind a model switch
        waited for the switch). Until stop 71 these went to anyio's ``to_thread``, whose
        worker threads the event loop started itself (``Thread.start`` waits for the new
        thread to be scheduled: 0.1-0.25 s on a starved host, every request waiting with
        it)."""
        limiter, bound = self._operator_limiter, self.config.operator_wait_s
        try:
            limiter.acquire_nowait()
        except anyio.WouldBlock:
            turn = False
            if bound > 0:
                with anyio.move_on_after(bound):
                    await limiter.acquire()
                    turn = True
            if not turn:
                held = "; ".join(self._operator_calls) or "none recorded"
                return OperatorBusy(Status.failure(
                    "operator.busy", Category.RESOURCE_EXHAUSTED, Phase.ADMISSION,
                    f"{what}: not run, the server's {OPERATOR_THREADS} operator calls at once "
                    f"are all busy after waiting {bound:g}s (operator_wait_s) for a turn: "
                    f"{held}; send it again once they answered"))
        self._operator_calls.append(what)
        try:
            return await self.in_worker(fn, *args)
        finally:
            self._operator_calls.remove(what)
            limiter.release()

    async def _run_job(self, run: RequestRun) -> tuple[Any, Any]:
        """Enqueue the request's next job and wait for it: (result, handle)."""
        def on_created(created) -> None:
            self._created(run, created)

        def enqueue(request: InferenceRequest):
            with run.mu:  # the fence with finish(): no enqueue starts once the request ended
                if run.closed:
                    return None
                run.enqueue_idle.clear()
            try:
                if streamed:
                    return self._stream_submit(run, request)
                return self.executor.enqueue(request, run.logits, on_created=on_created)
            finally:
                run.enqueue_idle.set()

        request = run.next_request()
        # a prompt token fed for its row goes through the plain path (``enqueue``): the
        # decode stream (pre-armed, greedy ahead) opens for the generated tokens only
        streamed = self._streamed(run, request)
        limiter = (self._admit_limiter if request.kind == TaskKind.PREFILL_IDS
                   else self._stream_limiter if streamed else self._limiter)
        inline = self.config.inline_waits
        handle = (self._stream_submit_nowait(run, request)
                  if inline and streamed and run.decode is not None else None)
        try:
            if handle is None:  # may block (admission, arming): a worker thread's
                handle = await self.in_worker(enqueue, request, limiter=limiter,
                                             abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            # Flag first, then cancel the current handle: whichever of this and on_created
            # runs second sees the other's write, so the new job is always cancelled.
            run.abandoned = True
            if run.handle is not None:
                run.handle.cancel()  # the enqueue thread sees the cancel and releases
            raise
        if handle is None:
            return Status.cancelled(Phase.CANCEL, "request already finished"), None
        if isinstance(handle, Status):  # the decode stream refused the step (and closed)
            return handle, None
        try:
            if inline:  # parks no thread: the resolving thread wakes this loop
                result = await handle.wait_async(run.deadline)
            if streamed:  # the stream's wait advances it (its deadline is the request's)
                stream = run.decode
                if inline and handle.done:
                    result = stream.wait()  # the step is resolved: returns at once
                else:  # blocks, or cancels and closes past the deadline (may wait)
                    result = await self.in_worker(stream.wait, limiter=self._stream_limiter,
                                                 abandon_on_cancel=True)
            elif not inline:
                result = await self.in_worker(handle.wait_until, run.deadline,
                                              limiter=self._limiter, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            handle.cancel()
            raise
        return result, handle

    def _stream_submit_nowait(self, run: RequestRun, request: InferenceRequest
                              ) -> CompletionHandle | Status | None:
        """The request's next decode step on the event loop, when its open decode stream takes
        it without blocking (``DecodeStream.submit_nowait``: fired ahead or pre-armed): the
        handle, the Status the stream answered, or None (``_run_job`` then submits on a
        worker thread, as without ``inline_waits``). Inside the same fence with finish() as
        ``enqueue``; an ended request answers like it."""
        stream, tokens = run.decode, request.tokens
        if stream is None or stream.closed or tokens is None:
            return None
        with run.mu:
            if run.closed:
                return Status.cancelled(Phase.CANCEL, "request already finished")
            run.enqueue_idle.clear()
        try:
            handle: CompletionHandle | Status | None = stream.submit_nowait(int(tokens[0]))
            if handle is not None and not isinstance(handle, Status):
                run.handle = handle  # reachable for a disconnect, as on_created makes it
                if run.abandoned:
                    handle.cancel()
            return handle
        finally:
            run.enqueue_idle.set()

    def _stream_submit(self, run: RequestRun, request: InferenceRequest) -> Any:
        """Fire the request's next decode job through its pre-armed decode stream (opened on
        the first decode of a sequence): the handle, or the Status the stream refused with.
        Runs in a worker thread inside the enqueue fence."""
        stream, seq_id, tokens = run.decode, run.seq_id, request.tokens
        if seq_id is None or tokens is None:  # (a leased run's decode request: neither is)
            return Status.invalid(4, f"seq_id={seq_id}, tokens={tokens} for kind=DECODE")
        if stream is None or stream.closed:
            ahead = self.config.greedy_ahead and run.sampling.raw_argmax
            stream = run.decode = self.executor.decode_stream(
                seq_id, request.past_len, run.deadline, logits_out=run.logits,
                max_len=len(run.prompt) + run.max_tokens, request_id=run.request_id,
                greedy_ahead=ahead,
                stop_tokens=(*(() if run.sampling.ignore_eos else (self.config.end_token_id,)),
                             *run.sampling.stop_token_ids),
                max_steps=run.max_tokens - len(run.tokens))
        handle = stream.submit(int(tokens[0]))
        if isinstance(handle, Status):
            return handle
        run.handle = handle  # reachable for a disconnect, as on_created makes it
        if run.abandoned:
            handle.cancel()
        return handle

    def _generation_moved(self, run: RequestRun, result: Status | None = None) -> Status | None:
        """UNAVAILABLE (retry) when the request's KV generation is no longer the executor's:
        a recovery or model switch ended it between two of its jobs (its KV died with it)."""
        if run.generation_id is None:
            return None
        contracts = self.executor.generation  # (not snapshot(): this runs once per token)
        current = None if contracts is None else contracts.generation_id
        if current == run.generation_id:
            return None
        # the drain's grace ran out (the executor is shut down after it), or the lifecycle
        # ended while draining: the drain ended it. Not a switch or a recovery that retired
        # the generation while a drain had just begun (its grace running): that is told as
        # below (it said the grace had run out)
        if self.grace_over or (current is None and self.draining and self._executor_final()):
            return self._drained(run)
        # (no generation now: the recovery or switch retired the request's and has not yet
        # opened the next one; said so, not "replaced by None")
        by = ("retired; the next one is not open yet" if current is None
              else f"replaced by {current}")
        return Status.unavailable(Phase.ADMISSION, f"the request's generation {run.generation_id}"
                                  f" was {by} (recovery or model switch); retry",
                                  seq_id=run.seq_id)

    def _drained(self, run: RequestRun) -> Status:
        """UNAVAILABLE (retry): the drain's grace ran out before ``run`` finished and the
        executor's shutdown ended it (docs/server.md "Drain")."""
        return Status.unavailable(Phase.ADMISSION, f"server drained: its grace "
                                  f"({self.drain_grace:g} s) ran out before the request "
                                  "finished; retry", seq_id=run.seq_id)

    async def finish(self, run: RequestRun, abandoned: bool = False) -> None:
        """Finish a request at once: cancel its job if one is still running, record metrics
        and the dump record, and give its sequence id back once its last job ended (now when
        it has, else from a background thread). ``abandoned``: an unfinished generation was
        given up by its client (cancelled). Shielded and never raises: runs to the end even
        when the request task is being cancelled, so a request never stays "running" (its
        one await is shielded, ``_release_shielded``: a cancel reaches a task only there)."""
        if run.finished:
            return
        run.finished = True
        try:
            if abandoned and not run.done:  # the request task ended early: client left
                run.status = Status.cancelled(Phase.CANCEL, "client disconnected")
            await self._give_back(run)
        finally:
            try:
                self._record(run)
            except Exception:
                log.exception("recording request %d", run.request_id)
            self._live.pop(run.request_id, None)
            self.active -= 1

    async def generation_ended(self, run: RequestRun) -> None:
        """(A streamed route, once ``advance`` returned None: the generation ended.) Give back
        now what the request holds on the device (its job, decode stream, sequence id, KV
        blocks, slot): the bytes still to send are made. The request stays in progress until
        its response ends (``finish``: its record, the cancel and the drain still find it).
        Until stop 75 a stream whose last send waited for a client that stopped reading held
        its sequence until its deadline + ``deadline_slack_s``. Never raises."""
        if not run.finished:
            await self._give_back(run)

    async def _give_back(self, run: RequestRun) -> None:
        """(``finish``, ``generation_ended``; once) Cancel the run's job if one is still
        running and give its sequence id back once its last job ended (now when it has, else
        from a background thread). Never raises."""
        if run.given_back:
            return
        run.given_back = True
        try:
            with run.mu:
                run.closed = True  # no enqueue starts after this
                run.burst_room.notify_all()  # a streamed burst waiting for room ends
            idle = run.enqueue_idle.is_set()  # then none runs: run.handle is the last job
            handle = run.handle
            if handle is not None and not handle.done:
                handle.cancel()
            self.admission.leave(run.waiter)  # still waiting for a sequence id: no more
            if run.seq_id is None:  # it holds none (a resume released the failed one)
                pass
            elif idle and (handle is None or handle.done):
                # a step fired ahead and never taken (greedy ahead, a stop string) is
                # cancelled, never waited for here: while it runs, the background release
                # (whose close waits for it) gives the sequence back once it ended.
                # Without a decode stream nothing here can block (a KV release that does
                # not wait for the device: locks held for bookkeeping only), so it runs
                # on the loop, without a worker thread's round trip; a stream's close
                # may wait for an arming in progress: a worker thread's
                released = (self._close_and_release(run) if run.decode is None else
                            await self._release_shielded(run))
                if not released:
                    self.release_later(run)
            else:
                self.release_later(run)
        except Exception:  # never leave a request running or its id in limbo
            log.exception("finishing request %d", run.request_id)
            self.release_later(run)

    async def _release_shielded(self, run: RequestRun) -> bool:
        """``_close_and_release(run)`` in a release thread, run to its end even when the
        request task is being cancelled: ``finish``'s one await, so its one cancel scope
        (until stop 65 the whole of ``finish`` was one: a scope every request entered, about
        4 us of the event loop's CPU, for the few with a decode stream to close)."""
        with anyio.CancelScope(shield=True):
            try:  # a thread of ``_releases``: the loop starts none (stop 70)
                future = self._releases.submit(self._close_and_release, run)
            except RuntimeError:  # (the app stopped: the pool takes no new work)
                released = await to_thread.run_sync(self._close_and_release, run)
            else:
                released = await asyncio.wrap_future(future)
        return released

    async def cut(self, run: RequestRun) -> None:
        """The request's response was cut: one of its sends did not complete by the request's
        deadline + ``deadline_slack_s`` (a client that stopped reading), by the end of a
        drain, or an operator's cancel found it waiting in a send (``wire.SendCut``). It ends
        as ``request.client_stalled`` (499: nobody reads it; a cancelled one as its
        ``request.aborted``) and gives back
        now what it holds (``finish``): its job is cancelled, its decode stream closed, its
        sequence released."""
        if not run.finished and run.cancelled is not None:  # an operator's cancel cut it
            run.abandoned = True
            run.status = run.cancelled
        elif not run.finished:
            run.abandoned = True
            run.status = Status.failure(
                "request.client_stalled", Category.CANCELLED, Phase.CANCEL,
                "the client stopped reading: a send of the response did not complete by the "
                f"request's deadline + deadline_slack_s ({self.config.deadline_slack_s}s) or "
                "the end of the drain; response cut", seq_id=run.seq_id)
        await self.finish(run, abandoned=True)

    def live_requests(self) -> list[RequestRun]:
        """The requests in progress now (a copy: for diagnostics)."""
        return list(self._live.values())

    def running_requests(self) -> int:
        """How many requests are in progress now, a request of several choices (``n`` > 1, a
        prompt list) once, as :meth:`running_ids` names it once (``active`` counts its
        choices): the count of a log line that cuts them (a drain's end, a forced exit)."""
        return len({run.response_id if run.response_id is not None else run.request_id
                    for run in list(self._live.values())})

    def running_ids(self, limit: int = CUT_IDS_LOGGED) -> str:
        """The ``x-request-id`` s of the requests in progress, for a log line that cuts them:
        ``" (x-request-id: a, b and 3 more)"`` (the first ``limit`` distinct ids, in the
        order they were admitted; a request of several choices is one id), ``""`` when none
        has an id yet. An operator without ``--dump-dir`` matches a client's report to the
        cut by it."""
        return wire.cut_ids([run.x_request_id for run in list(self._live.values())
                             if run.x_request_id is not None], limit)

    def _close_and_release(self, run: RequestRun) -> bool:
        """(``finish``, a worker thread: one hand-off, not two) Close the run's decode stream
        without waiting; when none of its jobs is left, release its sequence now. True when
        the id is free again (else ``release_later``)."""
        return close_decode(run, False) and self.release_now(run.seq_id)  # type: ignore[arg-type]

    def release_now(self, seq_id: int) -> bool:
        """Release ``seq_id`` on the executor without waiting for the device and give it back
        to the pool; True when the id is free again (else ``release_later``)."""
        status = self.executor.release_sequence(seq_id, 0.0)
        if status.ok:
            self.sequences.release(seq_id)
        return status.ok

    def release_later(self, run: RequestRun) -> None:
        """Give ``run``'s sequence back from a background thread once its last job ended
        (``release_when_done``): a thread of ``_releases``, whose keeper starts it (until stop
        70 the caller started a thread of its own, and the event loop waited up to 0.25 s for
        it to be scheduled on a CPU-starved host)."""
        with self._releasing_mu:
            self._releasing += 1
        try:
            self._releases.submit(self._release_counted, run)
        except RuntimeError:  # (the app stopped: the pool takes no new work) a thread of its own
            threading.Thread(target=self._release_counted, args=(run,),
                             name=f"calexec-seq-release-{run.seq_id}", daemon=True).start()

    def _release_counted(self, run: RequestRun) -> None:
        try:
            self.release_when_done(run)
        finally:
            with self._releasing_mu:
                self._releasing -= 1

    def _executor_final(self) -> bool:
        return self.executor.state in ("Stopped", "Failed")

    def release_when_done(self, run: RequestRun) -> None:
        """Background: wait (in bounded slices) until no enqueue of the request runs and its
        last job ended, then release the sequence on the executor, retrying while the device
        still runs a job of it. The id is reused only after that; it is withheld when the
        executor ends (Stopped/Failed) first."""
        seq_id, step = run.seq_id, self.config.release_wait_s
        if seq_id is None:  # started only for a run that leased one
            return
        try:
            while not run.enqueue_idle.wait(min(step, 1.0)):
                pass
            close_decode(run)  # its pre-armed job holds KV of the sequence: released first
            handle = run.handle  # the last job: finish() closed the request to new ones
            if handle is not None:
                handle.cancel()
            while handle is not None and not handle.done and not self._executor_final():
                handle.wait_until(time.monotonic() + min(step, 1.0))
            status = Status.unavailable(Phase.RELEASE, f"job of sequence {seq_id} unresolved "
                                        "and the executor stopped", seq_id=seq_id)
            if handle is None or handle.done:
                # kv.sequence_busy: a job of the sequence is still being released by another
                # thread (close() waits for the submitter's release of a pre-armed job, but
                # only up to its bound); give it up to one ``release_wait_s`` before
                # withholding the id
                busy_until = time.monotonic() + step
                while True:  # slices of at most 1 s: the executor may end meanwhile
                    status = self.executor.release_sequence(seq_id, min(step, 1.0))
                    if status.ok or self._executor_final():
                        break
                    if status.code == "kv.sequence_busy" and time.monotonic() < busy_until:
                        time.sleep(0.005)
                        continue
                    if status.category != Category.UNAVAILABLE:
                        break
            if status.ok:
                self.sequences.release(seq_id)
            else:
                log.warning("sequence %d withheld: %s", seq_id, status)
                self.sequences.withhold(seq_id)
        except Exception:
            log.exception("releasing sequence %d", seq_id)
            self.sequences.withhold(seq_id)

    def _record_vllm(self, run: RequestRun) -> None:
        """A successful request's ``vllm:`` families (``ServerConfig.metrics_names``)."""
        if self.metrics.vllm is None:
            return
        end = time.monotonic()
        scheduled = run.started if run.scheduled_at is None else run.scheduled_at
        first = end if run.first_token_host is None else run.first_token_host
        self.metrics.vllm.finished(
            str(run.finish_reason), len(run.prompt), len(run.tokens), run.max_tokens,
            run.n_param, {"e2e": end - run.started, "queue": scheduled - run.started,
                          "inference": end - scheduled, "prefill": first - scheduled,
                          "decode": (run.last_token_at or end) - first})

    def _record(self, run: RequestRun) -> None:
        m = self.metrics
        if run.decode is not None:
            prearmed = run.decode.prearmed_steps
            m.decode_steps.labels("true").inc(prearmed)
            m.decode_steps.labels("false").inc(run.decode.steps - prearmed)
            m.decode_steps_ahead.inc(run.decode.ahead_steps)
        if run.handed_off:
            pass  # no failure: the sibling replica counts its end
        elif run.status is not None:
            m.observe_failure(run.status)
            if run.status.code == ABORTED and m.vllm is not None:
                m.vllm.success["abort"].inc()  # (vLLM's count of a request its engine aborted)
        else:
            m.success.labels(str(run.finish_reason)).inc()
            m.prompt_tokens.inc(len(run.prompt))
            m.generation_tokens.inc(len(run.tokens))
            m.request_prompt_tokens.observe(len(run.prompt))
            m.request_generation_tokens.observe(len(run.tokens))
            m.e2e.observe(time.monotonic() - run.started)
            if m.vllm is not None:
                self._record_vllm(run)
        if self.dump is not None:  # (queued: the sink's thread writes it, off the loop)
            self.dump.submit({
                "request_id": run.request_id, "x_request_id": run.x_request_id,
                "response_id": run.response_id,
                "seq_id": run.seq_id, "stream": run.sse,
                "prompt_tokens": len(run.prompt), "completion_tokens": len(run.tokens),
                "finish_reason": run.finish_reason,
                "status": None if run.status is None else run.status.to_dict(),
                "latency_s": round(time.monotonic() - run.started, 6),
                "last_job_timings": None if run.handle is None else run.handle.timings.to_dict(),
                # with the prompt ids, enough to replay the request's tokens (sampling.pick)
                "sampling": {"temperature": run.sampling.temperature, "top_p": run.sampling.top_p,
                             "top_k": run.sampling.top_k, "seed": run.sampling.seed,
                             "min_p": run.sampling.min_p,
                             "repetition_penalty": run.sampling.repetition_penalty,
                             "presence_penalty": run.sampling.presence_penalty,
                             "frequency_penalty": run.sampling.frequency_penalty,
                             "logit_bias": [list(pair) for pair in run.sampling.logit_bias]},
                "prompt_token_ids": run.prompt, "token_ids": run.tokens,
                "text": self.tokenizer.decode(run.tokens)})

    @contextlib.contextmanager
    def open_request(self, response_id: str | None = None, x_request_id: str | None = None
                     ) -> Iterator[OpenRequest]:
        """Around a request of several choices (drivers/serving/openai_api.py): a drain waits for
        it (within its grace) also while it holds no run, between one choice's end and the
        next one's admission, and a cancel by its ids finds it then (:class:`OpenRequest`:
        the route admits no choice of it once ``cancelled``)."""
        entry = OpenRequest(response_id, x_request_id)
        self._open_requests += 1
        self._open[id(entry)] = entry
        try:
            yield entry
        finally:
            self._open.pop(id(entry), None)
            self._open_requests -= 1

    @contextlib.contextmanager
    def arriving(self, scope: MutableMapping[str, Any], response_id: str
                 ) -> Iterator[OpenRequest]:
        """Around a completion route from its arrival (its response id named, its body still
        to read, its grammar to compile): a cancel by its response id or ``x-request-id``
        finds it (``OpenRequest.cancelled``), and its admission (:meth:`arrived`) refuses it
        with that cancel's ``request.aborted``. Until stop 74 such a cancel answered 404 (not
        in progress yet) and the request then ran. The entry rides in the ASGI ``scope``
        (``ARRIVAL``) to the admission; it leaves the registry there or when the route ends."""
        entry = OpenRequest(response_id, wire.request_id(scope))
        self._arriving[id(entry)] = entry
        scope[ARRIVAL] = entry
        try:
            yield entry
        finally:
            self._arriving.pop(id(entry), None)
            scope.pop(ARRIVAL, None)

    @property
    def arrivals(self) -> int:
        """Requests arrived and not admitted yet (``arriving``): 0 when the server is idle."""
        return len(self._arriving)

    @property
    def open_requests(self) -> int:
        """Requests of several choices in progress (``open_request``): 0 when idle."""
        return len(self._open)

    @staticmethod
    def arrival_renamed(scope: MutableMapping[str, Any], response_id: str) -> None:
        """The route took another response id (a fleet resume's) before its admission: the
        arrival entry names it (else a cancel by the ``x-request-id`` found two ids then)."""
        entry = scope.get(ARRIVAL)
        if isinstance(entry, OpenRequest):
            entry.response_id = response_id

    def arrived(self, scope: MutableMapping[str, Any]) -> Status | None:
        """(The route, right before its admission, nothing awaited between the two: no cancel
        falls in a gap.) The request leaves the arrivals; the ``request.aborted`` of a cancel
        that found it there (its admission refused with it), else None."""
        entry = scope.pop(ARRIVAL, None)
        if entry is None:
            return None
        self._arriving.pop(id(entry), None)
        return cast(OpenRequest, entry).cancelled

    def cancel(self, ident: str) -> CancelOutcome:
        """(The event loop.) An operator's cancel (``POST /admin/cancel/{id}``) of the request
        in progress whose response ``id`` or ``x-request-id`` is ``ident``: each of its runs
        (every choice) not yet ended is told (``RequestRun.cancelled``): the wait it is in
        (a sequence id, its job, a burst) is cancelled as a deadline's would be, its job
        cancelled (§7: the executor keeps what the device holds until the job ended; the
        sequence comes back through ``finish``'s release path), a burst's thread cut, no
        resume; it ends ``request.aborted``. An id naming two requests or more (one's
        response id another's ``x-request-id``, or two clients' one ``X-Request-Id``) tells
        none (``ambiguous``). Idempotent: a request told already is ``repeated``, told
        nothing more. A stream whose generation ended and whose response is still going out
        (``streams``) is cancelled too: a send of it waiting for its client is cut
        (``wire.SendCut``), a tail not sent yet replaced by the ``request.aborted`` error
        event, a single choice's request counted ``request.aborted`` (until stop 75 a 404,
        the stream held until its deadline)."""
        runs = [run for run in list(self._live.values())
                if ident in (run.response_id, run.x_request_id) and not run.finished]
        opened = [entry for entry in [*self._open.values(), *self._arriving.values()]
                  if ident in (entry.response_id, entry.x_request_id)]
        sending = [cut for cut in list(self.streams) if ident in cut.names and not cut.ended]
        keys = ({run.response_id or f"#{run.request_id}" for run in runs}
                | {entry.response_id or f"@{id(entry)}" for entry in opened}
                | {cut.names[0] or f"%{id(cut)}" for cut in sending})
        named = tuple(sorted(key for key in keys if not key.startswith(("#", "@", "%"))))
        x_ids = ({run.x_request_id for run in runs} | {e.x_request_id for e in opened}
                 | {cut.names[1] for cut in sending})
        x_request_id = next(iter(x_ids)) if len(x_ids) == 1 else None
        if len(keys) > 1:
            return self._cancel_counted(CancelOutcome("ambiguous", named))
        told = 0
        repeated = any(entry.cancelled is not None for entry in opened)
        repeated |= any(cut.asked for cut in sending)
        fresh = [cut for cut in sending if not cut.asked]  # (before the runs' cuts below)
        ended = 0  # streams whose generation had ended, cut
        for entry in opened:
            if entry.cancelled is None:
                entry.cancelled = aborted(ident)
        for run in runs:
            with run.mu:
                if run.cancelled is not None:
                    repeated = True
                    continue
                if run.done or run.closed:  # its generation ended: its answer is going out
                    if run.send_cut is not None and not run.send_cut.ended:
                        # (a stream: the cut below ends it request.aborted if it cuts a send)
                        run.cancelled = aborted(ident, run.seq_id)
                    continue
                run.cancelled = aborted(ident, run.seq_id)
            told += 1
            self._cut_burst(run)  # (a burst's thread commits nothing more; the job cancelled)
            scope = run.scope
            if isinstance(scope, asyncio.Timeout):
                wire.expire(scope)
            elif scope is not None:
                scope.cancel()
            if run.send_cut is not None:  # a stream blocked in its send is cut now (no waiting
                # for a client that stopped reading); one that reads gets its error event
                run.send_cut.cut(self.config.deadline_slack_s)
        for cut in fresh:
            if cut.asked:  # (a run told above cut it: its generation goes on)
                continue
            # its generation ended (stop 75): what it held on the device is back; a send
            # waiting for the client now is cut (the connection aborted, no [DONE]); a
            # client that reads gets the request.aborted error event instead of the tail,
            # each later send bounded by deadline_slack_s, as for a stream still generating
            cut.why = aborted(ident)
            cut.cut(self.config.deadline_slack_s)
            ended += 1
        if ended and not told:
            log.info("admin: cancelled request %s whose generation had ended: its response's "
                     "sends cut, x-request-id %s", fields.shown(ident, 128), x_request_id)
            return self._cancel_counted(CancelOutcome("cancelled", named, x_request_id))
        if told:
            log.info("admin: cancelled request %s (%d choice%s), x-request-id %s",
                     fields.shown(ident, 128), told, "" if told == 1 else "s", x_request_id)
            return self._cancel_counted(CancelOutcome("cancelled", named, x_request_id, told))
        if repeated:
            return self._cancel_counted(CancelOutcome("repeated", named, x_request_id))
        if opened:  # arriving, or between two choices: no choice (more) is admitted
            log.info("admin: cancelled request %s before its admission or between its choices, "
                     "x-request-id %s", fields.shown(ident, 128), x_request_id)
            return self._cancel_counted(CancelOutcome("cancelled", named, x_request_id))
        return self._cancel_counted(CancelOutcome("not_found"))

    def _cancel_counted(self, outcome: CancelOutcome) -> CancelOutcome:
        self.metrics.cancels.labels(outcome.outcome).inc()
        return outcome

    # ---- drain ----------------------------------------------------------------------------------
    async def flush_dump(self, timeout: float, close: bool = False) -> bool:
        """Wait (on a worker thread, at most ``timeout`` seconds) until the dump's records
        are written; ``close``: then end its writer, counting what it could not write
        (``DumpSink.close``). True without a dump."""
        dump = self.dump
        if dump is None:
            return True
        return await to_thread.run_sync(dump.close if close else dump.flush, timeout)

    async def _until_idle(self, until: float) -> None:
        """Wait (polling, bounded by ``until``, ``time.monotonic()``) for no admitted request."""
        while (self.active or self._open_requests) and time.monotonic() < until:
            await anyio.sleep(0.01)

    def start_drain(self, grace: float) -> asyncio.Task:
        """Begin a drain (idempotent: a later call changes nothing, ``drain_grace`` is the
        first one's): the running task."""
        if self._drain_task is None:
            self.drain_grace = grace
            self._drain_task = asyncio.get_running_loop().create_task(self.drain(grace))
        return self._drain_task

    async def drain(self, grace: float) -> Status:
        """Refuse new work (503), let admitted requests finish within ``grace`` seconds, then
        shut the executor down with the rest of the grace. Runs ``on_drained`` callbacks."""
        self.draining = True
        if self.drain_grace is None:  # called without start_drain
            self.drain_grace = grace
        self.admission.pump()  # requests waiting for a sequence id or Ready: 503 now
        deadline = time.monotonic() + grace
        await self._until_idle(deadline)
        # jobs of requests that ended (a deadline, a client gone) may still be on the device:
        # a hung one is recovered meanwhile (execution deadline, reset), which the shutdown
        # below would not do (it would end Failed, not drained)
        while self.releases_pending and time.monotonic() < deadline:
            await anyio.sleep(0.01)
        slack = self.config.deadline_slack_s
        self.grace_over = True
        # a client still sending its body gets the draining 503 now (uvicorn's shutdown
        # would cut its connection after SHUTDOWN_WAIT_S with a plain-text 500), told why:
        # the grace is over, or (at once, long before it) no admitted request was left
        self.bodies.cut("its grace ran out" if self.active or time.monotonic() >= deadline
                        else "no admitted request was left running, and it stopped waiting,")
        if self.active:
            log.warning("drain: grace %gs over, %d request(s) still running are cut%s", grace,
                        self.running_requests(), self.running_ids())
            # the grace is over: a response still sending to a client that stopped reading
            # is cut now (it holds its sequence, KV and pre-armed slot until then), and what
            # it holds comes back (BoundedStreamingResponse, ``cut``)
            self.sends.cut(time.monotonic())
            await self._until_idle(time.monotonic() + slack)
        # the executor gets what is left of the grace, and at least the slack: a step fired
        # ahead for a request cut just now is still on the device for a moment
        status = await to_thread.run_sync(self.executor.shutdown,
                                          max(deadline - time.monotonic(), slack))
        await self._until_idle(time.monotonic() + slack)  # requests the shutdown ended
        await self.flush_dump(max(deadline - time.monotonic(), slack), close=True)
        if status.ok and self.active:
            status = Status.failure("shutdown.requests_pending", Category.DEVICE, Phase.SHUTDOWN,
                                    f"{self.active} requests still running after grace={grace}s")
        self.drain_status = status
        for callback in self.on_drained:
            callback(status)
        return status


class RouteService:
    """How an app's closures (its routes, exception handlers, lifespan) reach its
    :class:`CompletionService`, and through it the executor: by a weak reference, each
    closure taking ``owner.service`` once per call. ``app.state.service`` is the service's
    one owner, so the service and its executor (numpy buffers, tens of MB) live as long as
    the app, whatever holds a route function after it: FastAPI (0.163) keeps up to 4096 route
    functions in module-level caches (``fastapi.dependencies.models``), and while their
    closures held the service a process creating app after app (the test suite, an embedder
    serving a new executor) kept some 200 old executors alive. (Not a ``weakref.proxy``: a
    dead one left in those caches raises ``ReferenceError`` at an ``isinstance`` of a heap
    walk, ``gc.get_objects()``.)"""

    __slots__ = ("_ref",)

    def __init__(self, service: CompletionService) -> None:
        self._ref = weakref.ref(service)

    @property
    def service(self) -> CompletionService:
        """The service; RuntimeError once it is gone (only a route of a dropped app, which
        nothing can call, would find it so)."""
        service = self._ref()
        if service is None:
            raise RuntimeError("the app's CompletionService is gone: its app was dropped")
        return service
