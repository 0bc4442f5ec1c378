"""Prometheus metrics of the reference server (spec §10.3, S11), prefix ``calexec_``.

Names follow vLLM's server metrics (``vllm:time_to_first_token_seconds`` ->
``calexec_time_to_first_token_seconds``). Every histogram is fed from the timings of one job
(``InferenceResult.timings``, S11: never a map shared by sequence id) or one request, when it
ends. Gauges are read from ``DeviceExecutor.snapshot()`` at scrape time by a custom collector,
so a scrape always shows the executor's current state. Each :class:`ServerMetrics` owns its own
``CollectorRegistry``: apps can be built repeatedly in one process.

==========================================  =========  =================================================
name                                        type       labels / meaning
==========================================  =========  =================================================
calexec_time_to_first_token_seconds         histogram  request arrival -> prefill job completed
calexec_time_per_output_token_seconds       histogram  each decode job, accepted -> completed
calexec_e2e_request_latency_seconds         histogram  request arrival -> last token
calexec_job_admission_wait_seconds          histogram  kind; accepted -> KV and token budget obtained
calexec_job_queue_wait_seconds              histogram  kind; queued -> infer() accepted (§9.1 queue)
calexec_job_device_wait_seconds             histogram  kind; time spent in Wait()
calexec_job_h2d_seconds                     histogram  kind; host->device copy, when a job measured it
calexec_job_d2h_seconds                     histogram  kind; device->host copy, when a job measured it
calexec_job_postprocess_seconds             histogram  kind; output checks + BF16->FP32 conversion
calexec_api_requests_total                  counter    route, outcome (success|failed|refused), model_name; requests
calexec_requests_total                      counter    stream, model_name; completion requests (choices) admitted
calexec_request_success_total               counter    finished_reason (stop|length), model_name
calexec_request_failures_total              counter    category, code, raw (CalRT code or "none"), model_name
calexec_request_prompt_tokens               histogram  model_name; prompt tokens of each successful request
calexec_request_generation_tokens           histogram  model_name; generated tokens of each successful request
calexec_prompt_tokens_total                 counter    prompt tokens of successful requests
calexec_generation_tokens_total             counter    generated tokens of successful requests
calexec_decode_steps_total{prearmed}       counter    decode jobs of decode streams (label: pre-armed or not)
calexec_decode_steps_ahead_total            counter    of those, fired with the argmax (greedy ahead)
calexec_decode_burst_jobs_total             counter    jobs taken in decode bursts (greedy, streamed or not)
calexec_executor_jobs_total                 counter    outcome; the executor's own job counters
calexec_relay_submitted_total               counter    jobs inferred from the native relay (serve --native-relay)
calexec_device_faults_total                 counter    category, code, raw; faults reported to the fault controller
calexec_submit_retries_total                counter    raw (17); infer() answered busy, retried by the submitter
calexec_num_requests_running                gauge      completion requests being served
calexec_num_requests_waiting                gauge      requests waiting for a sequence id or Ready
calexec_resumes_total                       counter    cause; generations resumed on a fresh sequence
calexec_resumed_tokens_reprefilled_total    counter    prompt + produced tokens re-prefilled by resumes
calexec_resume_lost_seconds                 histogram  time lost to one resume (failure -> re-prefill)
calexec_resume_budget_exhausted_total       counter    requests failed after spending their resume budget
calexec_jobs_inflight                       gauge      jobs submitted to the device (<= capacity)
calexec_queue_depth                         gauge      jobs prepared and waiting for infer()
calexec_pending_tokens                      gauge      admission token budget in use
calexec_buffer_slots                        gauge      state (Free|Leased|InFlight|Quarantined|Retired)
calexec_lifecycle_state                     gauge      state; 1 for the current lifecycle state
calexec_generation                          gauge      current model generation id (0: none)
calexec_kv_sequences_in_use                 gauge      KV sequence ids leased by the server
calexec_kv_sequences_free                   gauge      KV sequence ids free to lease
calexec_kv_sequences_withheld               gauge      sequence ids withheld after a failed release
calexec_kv_sequences_capacity               gauge      sequence ids owned (= free + in use + withheld)
calexec_kv_cache_usage_perc                 gauge      KV blocks reserved / KvManager capacity (0..1)
calexec_responses_send_waiting              gauge      streamed responses waiting for their client
calexec_stream_choices_waiting              gauge      choices of n > 1 streams waiting for room
calexec_stream_bursts_waiting               gauge      streamed decode bursts waiting for room
calexec_server_draining                     gauge      1 while the server drains
calexec_feature_disabled                    gauge      feature; 1 while a §8 PROGRAMMING fault keeps it off
calexec_golden_unpinned                     gauge      1 while serving on a golden no file pins (§9.2)
calexec_dump_records_total                  counter    outcome (written|dropped|error|overflow); with --dump-dir
calexec_admin_cancels_total                 counter    outcome (cancelled|repeated|not_found|ambiguous)
==========================================  =========  =================================================

With ``ServerConfig.metrics_names == "vllm"`` (``calexec serve --metrics-names vllm``) the
``vllm:`` families of vLLM's own server are exported beside these (:class:`VllmMetrics`;
docs/server.md lists them).
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from calexec.contracts.codes import CalrtCode
from calexec.contracts.status import Status
from calexec.contracts.types import JobTimings, TaskKind
from calexec.drivers.serving.executor_view import ServedExecutor
from calexec.machines.compiled import BUFFER_SLOT, LIFECYCLE
from calexec.machines.executor import FEATURES

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0)
TPOT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
               20.0, 30.0, 40.0, 50.0, 60.0)
#: 1-2-5 steps up to the synthetic model's max_seq (40960) and beyond
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5) if m * 10 ** e <= 100000)
STAGE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Snapshot = Callable[[], Mapping[str, Any]]


class _ExecutorCollector(Collector):
    """Scrape-time gauges and counters from the executor snapshot and the server's counts."""

    def __init__(self, snapshot: Snapshot, server_gauges: Callable[[], dict[str, float]]) -> None:
        self._snapshot = snapshot
        self._server_gauges = server_gauges

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield _gauge("calexec_jobs_inflight", "Jobs submitted to the device.", snap["inflight"])
        yield _gauge("calexec_queue_depth", "Jobs prepared and waiting for infer().",
                     snap["queued"])
        yield _gauge("calexec_pending_tokens", "Admission token budget in use.",
                     snap["pending_tokens"])
        yield _gauge("calexec_generation", "Current model generation id (0: none).",
                     snap["generation"] or 0)
        yield _gauge("calexec_inflight_capacity",
                     "Effective in-flight capacity (2 in Phase B until a downgrade).",
                     snap["inflight_capacity"])
        recoveries = CounterMetricFamily("calexec_recoveries",
                                         "Recoveries from faults (drain, reset, rebuild, golden) "
                                         "run by the executor; model switches not included.")
        recoveries.add_metric([], snap["recoveries"])
        yield recoveries
        dropped = CounterMetricFamily("calexec_recoveries_dropped",
                                      "Fault recoveries dropped unrun: asked for a generation a "
                                      "model switch had replaced when their turn came, or once "
                                      "the shutdown began.")
        dropped.add_metric([], snap.get("recoveries_dropped", 0))
        yield dropped
        switches = CounterMetricFamily("calexec_model_switches",
                                       "Model switches (POST /admin/reload) by outcome: ok, "
                                       "failed (rolled back or lifecycle failed).",
                                       labels=["outcome"])
        for outcome in ("ok", "failed"):
            switches.add_metric([outcome], snap.get("model_switches", {}).get(outcome, 0))
        yield switches
        faults = CounterMetricFamily("calexec_device_faults",
                                     "Faults reported to the executor's fault controller, by "
                                     "kind, whether their requests were resumed or failed.",
                                     labels=["category", "code", "raw"])
        for category, code, raw, n in snap.get("faults_reported", ()):
            faults.add_metric([category, code, "none" if raw is None else str(raw)], n)
        yield faults
        retries = CounterMetricFamily("calexec_submit_retries",
                                      "infer() calls the runtime refused as busy (raw CalRT "
                                      "code) that the submitter retried after a back-off.",
                                      labels=["raw"])
        retries.add_metric([str(int(CalrtCode.DEVICE_BUSY))], snap.get("submit_retries", 0))
        yield retries
        downgrades = CounterMetricFamily("calexec_pingpong_downgrades",
                                         "Automatic Phase B downgrades to in-flight capacity 1.")
        downgrades.add_metric([], snap["downgrades"])
        yield downgrades
        slots = GaugeMetricFamily("calexec_buffer_slots", "Buffer slots by BufferSlotChart state.",
                                  labels=["state"])
        counts = snap["slots"] or {}
        for state in BUFFER_SLOT.states:
            slots.add_metric([state], counts.get(state, 0))
        yield slots
        lifecycle = GaugeMetricFamily("calexec_lifecycle_state",
                                      "1 for the device lifecycle's current state.",
                                      labels=["state"])
        for state in LIFECYCLE.states:
            lifecycle.add_metric([state], 1.0 if snap["lifecycle"] == state else 0.0)
        yield lifecycle
        features = GaugeMetricFamily("calexec_feature_disabled",
                                     "1 while a PROGRAMMING fault keeps the feature off (until "
                                     "the next generation).", labels=["feature"])
        for name in FEATURES:
            features.add_metric([name], 1.0 if name in snap.get("disabled_features", ()) else 0.0)
        yield features
        yield _gauge("calexec_golden_unpinned", "1 while the current generation passed a golden "
                     "no file pins (allow_unpinned_golden).",
                     1.0 if snap.get("golden") == "unpinned" else 0.0)
        jobs = CounterMetricFamily("calexec_executor_jobs", "Executor job outcomes.",
                                   labels=["outcome"])
        for outcome in ("submitted", "succeeded", "failed", "quarantined", "cancelled"):
            jobs.add_metric([outcome], snap[outcome])
        yield jobs
        relayed = CounterMetricFamily("calexec_relay_submitted",
                                      "Jobs the submitter gave to infer from its native relay "
                                      "(serve --native-relay; 0 without it).")
        relayed.add_metric([], snap.get("relay_submitted", 0))
        yield relayed
        for name, value in self._server_gauges().items():
            yield _gauge(name, _SERVER_GAUGE_HELP[name], value)


class _DumpCollector(Collector):
    """``calexec_dump_records_total{outcome}`` at scrape time, from ``DumpSink.counts``."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "calexec_dump_records", "Request dump records (serve --dump-dir) by outcome: "
            "written, dropped by the size cap, refused by the file system (error), dropped "
            "with the writer too far behind (overflow).",
            labels=["outcome"])
        for outcome, value in self._counts().items():
            family.add_metric([outcome], value)
        yield family


_SERVER_GAUGE_HELP = {
    "calexec_num_requests_running": "Completion requests being served.",
    "calexec_num_requests_waiting": "Requests waiting for a KV sequence id or for Ready.",
    "calexec_kv_sequences_in_use": "KV sequence ids leased by the server.",
    "calexec_kv_sequences_free": "KV sequence ids free to lease.",
    "calexec_kv_sequences_withheld": "KV sequence ids withheld after a failed release.",
    "calexec_kv_sequences_capacity": "KV sequence ids the server owns "
                                     "(= free + in use + withheld).",
    "calexec_server_draining": "1 while the server drains.",
    "calexec_kv_cache_usage_perc": "KV blocks reserved by the sequences of the current "
                                   "generation / the KvManager's capacity (0..1).",
    "calexec_responses_send_waiting": "Streamed responses whose send waits for the client to "
                                      "read (cut at the request's deadline + slack).",
    "calexec_stream_choices_waiting": "Choices of streamed requests of several choices whose "
                                      "next chunk waits for the client to take the ones "
                                      "queued (STREAM_AHEAD a choice).",
    "calexec_stream_bursts_waiting": "Streamed decode bursts whose thread waits for the "
                                     "loop to send the STREAM_AHEAD tokens it took ahead.",
}


def kv_usage_fraction(executor: ServedExecutor) -> float:
    """Blocks the current generation's sequences hold reserved over the KvManager's
    capacity, from the executor's snapshot (``kv_blocks_reserved``, ``kv_blocks_capacity``:
    the coordinator's host-side view, no device call): 0 when there is no generation or the
    runtime does not report its capacity."""
    snap = executor.snapshot()
    capacity = snap["kv_blocks_capacity"]
    if not capacity:
        return 0.0
    return min(1.0, snap["kv_blocks_reserved"] / capacity)


#: ``ServerConfig.metrics_names``: ``calexec`` (the calexec_ families only) or ``vllm`` (the
#: ``vllm:`` families too, as vLLM's own metrics test expects them)
METRICS_NAMES = ("calexec", "vllm")
#: vLLM's labels on every ``vllm:`` family (one engine here: "0")
VLLM_LABELS = ("model_name", "engine")
#: vLLM's request latency buckets (queue, inference, prefill, decode, e2e)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TOKEN_INTERVAL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
#: vLLM's finish reasons (request_success's label values, shown from 0)
VLLM_FINISH_REASONS = ("stop", "length", "abort")
#: the server gauge each scrape-time ``vllm:`` gauge reads
_VLLM_GAUGES = {
    "vllm:num_requests_running": ("calexec_num_requests_running",
                                  "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("calexec_num_requests_waiting",
                                  "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("calexec_kv_cache_usage_perc",
                                 "KV-cache usage. 1 means 100 percent usage."),
    "vllm:gpu_cache_usage_perc": ("calexec_kv_cache_usage_perc",
                                  "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: "
                                  "Use vllm:kv_cache_usage_perc instead."),
}


class _VllmCollector(Collector):
    """Scrape-time ``vllm:`` gauges from the server's gauges, and ``vllm:cache_config_info``."""

    def __init__(self, model_name: str, server_gauges: Callable[[], dict[str, float]],
                 cache_info: Callable[[], dict[str, str]]) -> None:
        self._values = (model_name, "0")
        self._server_gauges = server_gauges
        self._cache_info = cache_info

    def collect(self) -> Iterator[Metric]:
        gauges = self._server_gauges()
        for name, (source, doc) in _VLLM_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=list(VLLM_LABELS))
            family.add_metric(list(self._values), gauges[source])
            yield family
        info = {**self._cache_info(), "engine": "0"}
        family = GaugeMetricFamily("vllm:cache_config_info",
                                   "Information of the LLMEngine CacheConfig",
                                   labels=list(info))
        family.add_metric(list(info.values()), 1.0)
        yield family


class VllmMetrics:
    """The ``vllm:`` families vLLM's server exports (``--metrics-names vllm``), with vLLM's
    names, types, buckets and labels (``model_name``, ``engine``), fed from the same points as
    the ``calexec_`` ones: per generated token (``token``) and per finished request
    (``finished``). Families this server has nothing to count in stay at 0: the prefix cache
    (there is none) and preemptions (a request reserves its whole KV up front, §7: never
    preempted)."""

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 server_gauges: Callable[[], dict[str, float]],
                 cache_info: Callable[[], dict[str, str]]) -> None:
        values = (model_name, "0")

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return LeanHistogram(name, doc, VLLM_LABELS, buckets=buckets,
                             registry=registry).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, VLLM_LABELS, registry=registry).labels(*values)

        for name, doc in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                 "queried tokens (no prefix cache here: 0)."),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                 "tokens (no prefix cache here: 0)."),
                ("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries (DEPRECATED: "
                 "vllm:prefix_cache_queries; 0 here)."),
                ("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits (DEPRECATED: "
                 "vllm:prefix_cache_hits; 0 here)."),
                ("vllm:num_preemptions", "Cumulative number of preemption from the engine "
                 "(a request reserves its whole KV up front: never preempted).")):
            counter(name, doc)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*VLLM_LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*values, reason)
                        for reason in VLLM_FINISH_REASONS}
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            TOKEN_BUCKETS)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            VLLM_ITERATION_BUCKETS)
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", TOKEN_BUCKETS)
        self.params_n = histogram("vllm:request_params_n",
                                  "Histogram of the n request parameter.", VLLM_N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            TOKEN_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds.",
                              VLLM_TOKEN_INTERVAL_BUCKETS)
        self.inter_token = histogram("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.",
                                     VLLM_TOKEN_INTERVAL_BUCKETS)
        self.prefill_per_token = histogram(
            "vllm:time_per_prefill_token_request_seconds",
            "Time spent per token during prefill phase in seconds", VLLM_PREFILL_TOKEN_BUCKETS)
        self.phases = {
            phase: histogram(f"vllm:{name}", doc, VLLM_REQUEST_BUCKETS)
            for phase, name, doc in (
                ("e2e", "e2e_request_latency_seconds",
                 "Histogram of e2e request latency in seconds."),
                ("queue", "request_queue_time_seconds",
                 "Histogram of time spent in WAITING phase for request."),
                ("inference", "request_inference_time_seconds",
                 "Histogram of time spent in RUNNING phase for request."),
                ("prefill", "request_prefill_time_seconds",
                 "Histogram of time spent in PREFILL phase for request."),
                ("decode", "request_decode_time_seconds",
                 "Histogram of time spent in DECODE phase for request."))}
        registry.register(_VllmCollector(model_name, server_gauges, cache_info))

    def token(self, first: bool, prompt_tokens: int, since_last: float) -> None:
        """One generated token: vLLM's engine step (the first one prefilled the prompt too);
        ``since_last``: seconds since the request's previous token (or its arrival)."""
        self.iteration_tokens.observe(prompt_tokens + 1 if first else 1)
        if first:
            self.ttft.observe(since_last)
        else:
            self.tpot.observe(since_last)
            self.inter_token.observe(since_last)

    def finished(self, reason: str, prompt_tokens: int, generated: int, max_tokens: int,
                 n: int | None, spans: dict[str, float]) -> None:
        """One request finished successfully. ``spans``: seconds of its phases, keys e2e,
        queue (arrival -> a sequence id), inference (-> the end), prefill (-> first token),
        decode (first -> last token)."""
        self.success.get(reason, self.success["stop"]).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)
        self.params_max_tokens.observe(max_tokens)
        self.max_num_generation_tokens.observe(max_tokens)
        if n is not None:
            self.params_n.observe(n)
        for phase, seconds in spans.items():
            self.phases[phase].observe(max(0.0, seconds))
        if prompt_tokens:
            self.prefill_per_token.observe(max(0.0, spans["prefill"]) / prompt_tokens)


#: the routes ``calexec_api_requests_total`` counts, by path: the label ``route``
API_ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
              "/v1/responses": "responses"}
#: ``calexec_api_requests_total``'s outcomes: answered whole (a 200 body, or a stream whose
#: route said it sent its last event, :func:`mark_whole`: ``[DONE]``, or a Responses stream
#: its ``response.completed`` / ``response.incomplete`` event); refused (a failure the route
#: counted: never admitted, or a later choice of it refused admission); failed (anything
#: else: an error after admission, a stream's error event, the client gone, a cut);
#: handed_off (a fleet request a draining replica handed to a sibling at a token boundary,
#: drivers/serving/handoff.py: the sibling counts its outcome, so a sum over replicas counts
#: it once outside ``handed_off``)
API_OUTCOMES = ("success", "failed", "refused", "handed_off")


class _Tally:
    """What the route said of the request ``RequestTally`` counts (``refused``,
    ``handed_off``, a stream sent ``whole``)."""

    __slots__ = ("handed_off", "refused", "whole")

    def __init__(self) -> None:
        self.refused = False
        self.handed_off = False
        self.whole = False


def mark_whole(whole: bool = True) -> None:
    """The route's stream (a request of ``API_ROUTES``, in this task) is about to send its
    last event, answered whole (``[DONE]``; a Responses stream's ``response.completed`` or
    ``response.incomplete``): ``calexec_api_requests_total`` counts it ``success``.
    ``whole=False``: a route relaying such a stream answered otherwise after all (the
    Responses' translation of a chat stream failed). The last word counts. Said by the
    route, never read from the bytes: a model's answer could hold any byte pattern. No-op
    outside such a request."""
    tally = _TALLY.get()
    if tally is not None:
        tally.whole = whole


def mark_handed_off() -> None:
    """The route's request (of ``API_ROUTES``, in this task) was handed to a sibling replica:
    ``calexec_api_requests_total`` counts it ``handed_off``, not ``failed`` (the sibling
    counts how it ended). No-op outside such a request."""
    tally = _TALLY.get()
    if tally is not None:
        tally.handed_off = True


#: the request (of ``API_ROUTES``) whose task this is: its refusal is marked here
_TALLY: ContextVar[_Tally | None] = ContextVar("calexec_api_request", default=None)

_Asgi = Callable[[Any, Any, Any], Awaitable[None]]


def api_route(scope: Any) -> str | None:
    """The ``calexec_api_requests_total`` route of an ASGI ``scope`` (a ``POST`` to one of
    ``API_ROUTES``): a completion, chat or Responses request, whose failures and refusals
    ``calexec_request_failures_total`` counts; None for any other request (another route's
    refusal or bug is answered, not counted: its successes are counted nowhere)."""
    if scope.get("type") != "http" or scope.get("method") != "POST":
        return None  # (a CORS preflight or a wrong method answers no completion request)
    return API_ROUTES.get(scope.get("path", ""))


class RequestTally:
    """ASGI middleware: each request of ``API_ROUTES`` counted once when its answer ends, in
    ``calexec_api_requests_total{route, outcome}`` (``API_OUTCOMES``). The unit is the HTTP
    request, whatever its choices (``n``, a prompt list), where ``calexec_requests_total``,
    ``_request_success_total`` and ``_request_failures_total`` count admitted choices."""

    def __init__(self, app: _Asgi, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = api_route(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        tally = _Tally()
        token = _TALLY.set(tally)
        status: int | None = None
        stream = False
        counted = False

        def count(escaped: bool = False) -> None:
            nonlocal counted
            if not counted:
                counted = True
                outcome = ("refused" if tally.refused or escaped
                           else "handed_off" if tally.handed_off
                           else "success" if status == 200 and (not stream or tally.whole)
                           else "failed")
                self.metrics.api_requests.labels(route, outcome).inc()

        async def counting_send(message: Any) -> None:
            nonlocal status, stream
            if message["type"] == "http.response.start":
                status = message["status"]
                stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body":
                if not message.get("more_body", False):
                    count()  # before the client can see the answer end
            await send(message)
        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            count(escaped=True)  # a bug: the app's 500, counted as a failure by its handler
            raise
        finally:
            _TALLY.reset(token)
            count()  # (no last body sent: the client gone, a cut)


class _WithModel:
    """A labelled metric whose last label, ``model_name``, is bound: ``labels(*rest)``. The
    children are kept once looked up (the metric's own ``labels()`` takes its lock and
    checks every value, about 2.4 us against 0.1, twice per request on the event loop;
    stop 63): the same child objects, so the exposition is unchanged. Nothing removes a
    child of these metrics."""

    def __init__(self, metric: Any, model_name: str) -> None:
        self.metric = metric
        self.model_name = model_name
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:  # (two threads may both look it up: the metric gives one child)
            child = self._children[values] = self.metric.labels(*values, self.model_name)
        return child


def created_series_shown() -> bool:
    """prometheus_client exports the ``_created`` series now (its process-wide switch,
    ``disable_created_metrics()`` or ``PROMETHEUS_DISABLE_CREATED_SERIES``): asked of an
    unregistered counter of its own, so :class:`LeanHistogram` shows what its histograms
    show."""
    probe = Counter("calexec_created_probe", "", registry=None)
    return any(sample.name.endswith("_created")
               for metric in probe.collect() for sample in metric.samples)


class LeanChild:
    """One series of a :class:`LeanHistogram`: ``observe`` is a bisect and one lock (a
    prometheus_client histogram takes two locks and scans its buckets in Python: about 4 us
    against 1 on the 2-core VM; seven per decode job, on the decode burst's thread)."""

    __slots__ = ("_bounds", "_counts", "_sum", "_lock", "created")

    def __init__(self, bounds: tuple[float, ...], lock: threading.Lock | None = None) -> None:
        """``lock``: the lock it takes (its family's shared one; None: a lock of its own)."""
        self._bounds = bounds
        self._counts = [0] * len(bounds)
        self._sum = 0.0
        self._lock = threading.Lock() if lock is None else lock
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """As prometheus_client's: the sum takes every amount, the first bucket whose bound is
        at least the amount counts it (NaN: none)."""
        i = bisect.bisect_left(self._bounds, amount)
        with self._lock:
            self._sum += amount
            if amount == amount:  # (NaN is <= no bound)
                self._counts[i] += 1

    def state(self) -> tuple[list[int], float]:
        """(count per bucket, sum), read together."""
        with self._lock:
            return list(self._counts), self._sum


class LeanGroup:
    """Series of :class:`LeanHistogram` families that share one lock (``LeanHistogram(...,
    lock=)``), observed together: one lock taken for all of them, each amount counted as
    :meth:`LeanChild.observe` counts it. ``ServerMetrics.observe_job`` observes a job's six
    stage spans and its time per output token this way (once per job on the decode burst's
    thread: one lock where it took seven; issue 28, stop 68;
    ``tests/test_metrics_job_observe.py`` against the plain path)."""

    __slots__ = ("_lock", "_children")

    def __init__(self, children: Sequence[LeanChild]) -> None:
        locks = {id(child._lock) for child in children}
        if len(locks) != 1:
            raise ValueError(f"a LeanGroup's series must share one lock: {len(locks)} locks "
                             f"among {len(children)} series (give their families one lock)")
        self._lock = children[0]._lock
        self._children = tuple(children)

    def observe_ms(self, amounts_ms: Sequence[float | None]) -> None:
        """Observe ``amounts_ms[i] / 1000.0`` (ms as seconds) in series ``i`` of the group,
        for each amount that is not None; amounts past the group's last series are not
        observed (a group without a decode's tpot series ignores that amount)."""
        with self._lock:
            for child, ms in zip(self._children, amounts_ms, strict=False):
                if ms is None:
                    continue
                amount = ms / 1000.0
                child._sum += amount
                if amount == amount:  # (NaN is <= no bound)
                    child._counts[bisect.bisect_left(child._bounds, amount)] += 1


class LeanCount:
    """One series of a :class:`LeanCounter`: ``inc`` is one Python call and one lock, where
    prometheus_client's counter took four calls (its observability check and its value's
    own ``inc``); six counts a request on the event loop (issue 28, stop 74)."""

    __slots__ = ("_value", "_lock", "created")

    def __init__(self) -> None:
        self._value = 0.0
        self._lock = threading.Lock()
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        """As prometheus_client's: a negative amount is refused (ValueError), nothing counted."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        with self._lock:
            self._value += amount

    def get(self) -> float:
        with self._lock:
            return self._value


class LeanCounter(Collector):
    """A counter family exported exactly as prometheus_client's ``Counter`` exports it (the
    name without a ``_total`` it was given, help, label order, the ``_total`` series and
    ``_created`` when prometheus_client shows it, children in the order first looked up),
    with a cheaper ``inc`` (:class:`LeanCount`). ``tests/test_perf_probe74.py`` checks the
    exposition against prometheus_client's for the same counts. Nothing removes a child."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name = name[:-len("_total")] if name.endswith("_total") else name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], LeanCount] = {}
        self._lock = threading.Lock()
        if not self.labelnames:
            self._children[()] = LeanCount()
        if registry is not None:
            registry.register(self)

    def labels(self, *values: Any) -> LeanCount:
        """The series of these label values (created on first use)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"counter {self.name}: {len(values)} label values for the "
                             f"labels {list(self.labelnames)}")
        key = tuple(str(v) for v in values)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = LeanCount()
            return child

    def inc(self, amount: float = 1) -> None:
        """A count of the family without labels."""
        if self.labelnames:
            raise ValueError(f"counter {self.name} has labels {list(self.labelnames)}: "
                             "count a child of labels()")
        self._children[()].inc(amount)

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, "counter")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "counter")
        created = created_series_shown()
        with self._lock:
            children = list(self._children.items())
        for values, child in children:
            series = dict(zip(self.labelnames, values, strict=True))
            metric.add_sample(self.name + "_total", series, child.get())
            if created:
                metric.add_sample(self.name + "_created", dict(series), child.created)
        return [metric]


class LeanHistogram(Collector):
    """A histogram family exported exactly as prometheus_client's ``Histogram`` exports it
    (same name, help, buckets, label order, cumulative ``_bucket`` series, ``_count``,
    ``_sum``, ``_created`` when prometheus_client shows it), with a cheaper ``observe``
    (:class:`LeanChild`) for the families observed per job and per token (issue 28, stop 64).
    ``tests/test_metrics_lean_histogram.py`` checks the exposition against
    prometheus_client's for the same observations. Nothing removes a child."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (),
                 buckets: Sequence[float] = (), registry: CollectorRegistry | None = None,
                 lock: threading.Lock | None = None) -> None:
        """``lock``: one lock every series of the family takes (families observed together
        share one, :class:`LeanGroup`); None: a lock of its own for each series."""
        bounds = [float(b) for b in buckets]
        if not bounds or bounds != sorted(bounds):
            raise ValueError(f"histogram {name}: buckets {list(buckets)} must be given in "
                             "ascending order")
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self._bounds = tuple(bounds)
        self._les = tuple(floatToGoString(b) for b in bounds)
        self._children: dict[tuple[str, ...], LeanChild] = {}
        self._lock = threading.Lock()
        self._series_lock = lock
        if not self.labelnames:
            self._children[()] = LeanChild(self._bounds, lock)
        if registry is not None:
            registry.register(self)

    def labels(self, *values: Any) -> LeanChild:
        """The series of these label values (created on first use)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"histogram {self.name}: {len(values)} label values for the "
                             f"labels {list(self.labelnames)}")
        key = tuple(str(v) for v in values)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = LeanChild(self._bounds, self._series_lock)
            return child

    def observe(self, amount: float) -> None:
        """An observation of the family without labels."""
        if self.labelnames:
            raise ValueError(f"histogram {self.name} has labels {list(self.labelnames)}: "
                             "observe a child of labels()")
        self._children[()].observe(amount)

    def describe(self) -> Iterable[Metric]:
        return [Metric(self.name, self.documentation, "histogram")]

    def collect(self) -> Iterable[Metric]:
        metric = Metric(self.name, self.documentation, "histogram")
        created = created_series_shown()
        with self._lock:
            children = list(self._children.items())
        for values, child in children:
            series = dict(zip(self.labelnames, values, strict=True))
            counts, total = child.state()
            acc = 0.0
            for le, count in zip(self._les, counts, strict=True):
                acc += count
                metric.add_sample(self.name + "_bucket", {**series, "le": le}, acc)
            metric.add_sample(self.name + "_count", dict(series), acc)
            if self._bounds[0] >= 0:
                metric.add_sample(self.name + "_sum", dict(series), total)
            if created:
                metric.add_sample(self.name + "_created", dict(series), child.created)
        return [metric]


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


#: the ``calexec_job_*_seconds`` stages in the order ``ServerMetrics.observe_job`` gives a
#: job's spans to its :class:`LeanGroup` (a decode job's time per output token after them)
_JOB_SPANS = ("admission_wait", "queue_wait", "device_wait", "h2d", "d2h", "postprocess")


#: ``calexec_admin_cancels_total``'s outcomes (``service.CancelOutcome``)
CANCEL_OUTCOMES = ("cancelled", "repeated", "not_found", "ambiguous")


class ServerMetrics:
    """The server's metrics in a registry of their own."""

    def __init__(self, snapshot: Snapshot, server_gauges: Callable[[], dict[str, float]],
                 model_name: str = "calexec", names: str = "calexec",
                 cache_info: Callable[[], dict[str, str]] = dict,
                 dump_counts: Callable[[], dict[str, int]] | None = None) -> None:
        """``server_gauges`` returns the values of the ``calexec_num_requests_running``,
        ``calexec_kv_sequences_{in_use,free,withheld,capacity}``,
        ``calexec_kv_cache_usage_perc``, ``calexec_responses_send_waiting``,
        ``calexec_stream_choices_waiting``, ``calexec_stream_bursts_waiting`` and
        ``calexec_server_draining`` gauges.
        ``model_name`` labels the request counters and token histograms (vLLM's label).
        ``names``: "vllm" adds the ``vllm:`` families (:class:`VllmMetrics`, ``self.vllm``;
        None otherwise), ``cache_info`` giving the labels of ``vllm:cache_config_info``.
        ``dump_counts`` (``DumpSink.counts``; None: no dump, no family) gives
        ``calexec_dump_records_total``."""
        if names not in METRICS_NAMES:
            raise ValueError(f"metrics names {names!r}: must be one of {METRICS_NAMES}")
        self.registry = CollectorRegistry()
        reg = self.registry
        if dump_counts is not None:
            reg.register(_DumpCollector(dump_counts))
        self.ttft = LeanHistogram("calexec_time_to_first_token_seconds",
                              "Request arrival to the prefill job's completion.",
                              buckets=TTFT_BUCKETS, registry=reg)
        # a job's stage spans and time per output token are observed together, one lock for
        # the job (observe_job, once per job on the decode burst's thread; stop 68)
        job_lock = threading.Lock()
        self.tpot = LeanHistogram("calexec_time_per_output_token_seconds",
                              "Decode job, accepted to completed.", buckets=TPOT_BUCKETS,
                              registry=reg, lock=job_lock)
        self.e2e = LeanHistogram("calexec_e2e_request_latency_seconds",
                             "Request arrival to its last token.", buckets=E2E_BUCKETS,
                             registry=reg)
        self.stages = {
            name: LeanHistogram(f"calexec_job_{name}_seconds", doc, ["kind"], buckets=STAGE_BUCKETS,
                            registry=reg, lock=job_lock)
            for name, doc in (("admission_wait", "Accepted to KV and token budget obtained."),
                              ("queue_wait", "Queued to infer() accepted (queue deadline span)."),
                              ("device_wait", "Time spent in Wait()."),
                              ("h2d", "Host to device copy, when the job measured it."),
                              ("d2h", "Device to host copy, when the job measured it."),
                              ("postprocess", "Output checks and BF16->FP32 conversion."))
        }
        # every family shows (count 0) before its first observation; the labelled children are
        # kept, so a job's observations look no label up (one per token, issue 28): a kind's
        # series in observe_job's order (_JOB_SPANS' stages, then a decode's tpot)
        self._job_series: dict[TaskKind, LeanGroup] = {
            kind: LeanGroup([*(self.stages[name].labels(kind.name.lower())
                               for name in _JOB_SPANS),
                             *([self.tpot.labels()] if kind == TaskKind.DECODE else [])])
            for kind in TaskKind}
        model = ["model_name"]
        self.api_requests = _WithModel(LeanCounter(
            "calexec_api_requests", "Completion and chat HTTP requests by outcome, each once "
            "whatever its choices: success (answered whole), refused (never admitted: "
            "counted once in calexec_request_failures_total), failed (after admission), "
            "handed_off (to a sibling replica by a drain: the sibling counts its outcome).",
            ["route", "outcome", *model], registry=reg), model_name)
        for route in API_ROUTES.values():  # every series shows, 0 until counted
            for outcome in API_OUTCOMES:
                self.api_requests.labels(route, outcome)
        self.requests = _WithModel(LeanCounter(
            "calexec_requests", "Completion requests (each choice) admitted: given a sequence "
            "id or a place in the waiting queue; one refused before is counted only in "
            "calexec_request_failures_total.", ["stream", *model], registry=reg), model_name)
        self.success = _WithModel(LeanCounter("calexec_request_success",
                                          "Completion requests finished.",
                                          ["finished_reason", *model], registry=reg), model_name)
        self.failures = _WithModel(LeanCounter(
            "calexec_request_failures",
            "Failed completion requests by category, code and raw CalRT code.",
            ["category", "code", "raw", *model], registry=reg), model_name)
        self.request_prompt_tokens = LeanHistogram(
            "calexec_request_prompt_tokens", "Prompt tokens of each successful request.", model,
            buckets=TOKEN_BUCKETS, registry=reg).labels(model_name)
        self.request_generation_tokens = LeanHistogram(
            "calexec_request_generation_tokens", "Generated tokens of each successful request.",
            model, buckets=TOKEN_BUCKETS, registry=reg).labels(model_name)
        self.prompt_tokens = LeanCounter("calexec_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=reg)
        self.generation_tokens = LeanCounter("calexec_generation_tokens",
                                         "Generated tokens of finished requests.", registry=reg)
        #: ``POST /admin/cancel/{id}`` by outcome (``CompletionService.cancel``); each series
        #: shows, 0 until counted
        self.cancels = LeanCounter("calexec_admin_cancels", "Operator cancels (POST "
                               "/admin/cancel/{id}) by outcome: cancelled (a request in "
                               "progress told to end), repeated (told before, still ending), "
                               "not_found (no request in progress has the id), ambiguous (the "
                               "id names several).", ["outcome"], registry=reg)
        for outcome in CANCEL_OUTCOMES:
            self.cancels.labels(outcome)
        self.decode_steps = LeanCounter("calexec_decode_steps", "Decode jobs fired through a decode "
                                    "stream, by whether the job was pre-armed before its token "
                                    "came (issue 17).", ["prearmed"], registry=reg)
        self.decode_steps_ahead = LeanCounter(
            "calexec_decode_steps_ahead", "Decode jobs of greedy requests fired by the "
            "executor's completion thread with the previous step's argmax, before the "
            "server asked for them (greedy ahead, issue 17).", registry=reg)
        self.burst_jobs = LeanCounter(
            "calexec_decode_burst_jobs", "Jobs (prefills and decode steps) of greedy "
            "requests taken one after the other by a worker thread: non-streamed, the event "
            "loop woken once for them (ServerConfig.decode_bursts); streamed, woken only when "
            "it waits for a token (ServerConfig.stream_bursts; issue 28).", registry=reg)
        reg.register(_ExecutorCollector(snapshot, server_gauges))
        self.vllm = (VllmMetrics(reg, model_name, server_gauges, cache_info)
                     if names == "vllm" else None)

    def observe_job(self, kind: TaskKind, timings: JobTimings) -> None:
        """One completed job's own timings (S11). ``h2d_ms``/``d2h_ms`` are observed only when
        the device measured them (> 0; the emulator does, ``OutputBuf.copy_ms``): CalRT 0.7.6
        gives the host no copy timing (the copies run inside the job, part of
        ``device_wait``), and JobTimings' 0 means "not measured", never an instant copy."""
        # (the spans in _JOB_SPANS' order, then the total: a decode job's time per output
        # token, which the group of another kind does not observe; one lock for the job)
        admission_wait, queue_wait, total = timings.spans_ms()
        self._job_series[kind].observe_ms((
            admission_wait, queue_wait, timings.device_wait_ms, timings.h2d_ms or None,
            timings.d2h_ms or None, timings.postprocess_ms, total))

    def observe_refusal(self, status: Status) -> None:
        """A failure the route counts (not a choice's end): the request is ``refused`` in
        ``calexec_api_requests_total`` (:class:`RequestTally`)."""
        self.observe_failure(status)
        tally = _TALLY.get()
        if tally is not None:
            tally.refused = True

    def observe_failure(self, status: Status) -> None:
        self.failures.labels("none" if status.category is None else status.category.value,
                             status.code,
                             "none" if status.raw is None else str(status.raw)).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
