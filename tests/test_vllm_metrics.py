"""Issue 27: vLLM-compatible metric names behind ``ServerConfig.metrics_names`` (``calexec
serve --metrics-names vllm``). After a few requests every name vLLM's own metrics test
(vllm-project/vllm, tests/entrypoints/openai/test_metrics.py, ``EXPECTED_METRICS_V1``) lists
is exported with vLLM's type and labels (``model_name``, ``engine``), and the counts its
``test_metrics_counts`` expects hold (N requests of P prompt tokens and M generated tokens);
the running, waiting and KV gauges go back to 0. Without the option no ``vllm:`` name shows.

The ``openai`` SDK against a loopback in-process server on the bundled emulator.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import LiveServer, started_executor, wait_for

MODEL = "calexec-qwen3-synthetic"

#: vLLM's test_metrics.py EXPECTED_METRICS_V1: the names it looks for in the exposition
EXPECTED_METRICS_V1 = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:iteration_tokens_total",
    "vllm:cache_config_info", "vllm:request_success_total",
    *(f"vllm:{family}_{suffix}"
      for family in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                     "request_params_max_tokens", "time_per_output_token_seconds",
                     "time_to_first_token_seconds", "inter_token_latency_seconds",
                     "e2e_request_latency_seconds", "request_queue_time_seconds",
                     "request_inference_time_seconds", "request_prefill_time_seconds",
                     "request_decode_time_seconds")
      for suffix in ("sum", "bucket", "count"))]

#: each family's type, as vLLM's loggers.py declares it
TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:gpu_prefix_cache_queries": "counter", "vllm:gpu_prefix_cache_hits": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    **{f"vllm:{name}": "histogram" for name in (
        "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
        "request_params_n", "request_params_max_tokens", "time_per_output_token_seconds",
        "time_to_first_token_seconds", "inter_token_latency_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_inference_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "request_max_num_generation_tokens",
        "time_per_prefill_token_request_seconds")},
}


def served(tmp_path, **config):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(**config))
    return executor, app


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict, family: str, name: str, **labels) -> float:
    for s in fams[family].samples:
        if s.name == name and labels.items() <= s.labels.items():
            return s.value
    raise AssertionError(f"no sample {name} {labels} in {family}")


def test_vllm_names_types_labels_and_counts(tmp_path):
    executor, app = served(tmp_path, metrics_names="vllm")
    prompt, requests, max_tokens = [7, 8, 9, 10, 11], 4, 6
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                   max_retries=0, timeout=30)
            for _ in range(requests):
                client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          extra_body={"ignore_eos": True})
            service = app.state.service
            wait_for(lambda: service.sequences.in_use == 0, what="every id back")
            text = httpx.get(f"{server.url}/metrics", timeout=10).text
        for name in EXPECTED_METRICS_V1:  # vLLM's test_metrics_exist
            assert name in text, name
        fams = families(text)
        for name, kind in TYPES.items():
            assert fams[name].type == kind, (name, fams[name].type)
            for s in fams[name].samples:
                assert s.labels.get("engine") == "0", (name, s.labels)
                if name != "vllm:cache_config_info":
                    assert s.labels["model_name"] == MODEL, (name, s.labels)
        success = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
        assert {"stop", "length", "abort"} <= success
        # vLLM's test_metrics_counts, its expected values for N requests of P and M tokens
        n, p, m = requests, len(prompt), max_tokens
        expected = {
            "vllm:time_to_first_token_seconds": [("_count", n)],
            "vllm:time_per_output_token_seconds": [("_count", n * (m - 1))],
            "vllm:inter_token_latency_seconds": [("_count", n * (m - 1))],
            "vllm:e2e_request_latency_seconds": [("_count", n)],
            "vllm:request_queue_time_seconds": [("_count", n)],
            "vllm:request_inference_time_seconds": [("_count", n)],
            "vllm:request_prefill_time_seconds": [("_count", n)],
            "vllm:request_decode_time_seconds": [("_count", n)],
            "vllm:request_prompt_tokens": [("_sum", n * p), ("_count", n)],
            "vllm:request_generation_tokens": [("_sum", n * m), ("_count", n)],
            "vllm:request_params_n": [("_count", n)],
            "vllm:request_params_max_tokens": [("_sum", n * m), ("_count", n)],
            "vllm:iteration_tokens_total": [("_sum", n * (p + m)), ("_count", n * m)],
            "vllm:prompt_tokens": [("_total", n * p)],
            "vllm:generation_tokens": [("_total", n * m)],
        }
        for family, suffixes in expected.items():
            for suffix, value in suffixes:
                assert sample(fams, family, family + suffix) == value, (family, suffix)
        assert sample(fams, "vllm:request_success", "vllm:request_success_total",
                      finished_reason="length") == n
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                      "vllm:kv_cache_usage_perc"):
            assert sample(fams, gauge, gauge) == 0, gauge
        assert sample(fams, "vllm:num_preemptions", "vllm:num_preemptions_total") == 0
    finally:
        executor.shutdown(5.0)


def test_n_counts_once_per_prompt_as_vllm_s_parent_requests(tmp_path):
    executor, app = served(tmp_path, metrics_names="vllm", max_sequences=4)
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                   max_retries=0, timeout=30)
            client.completions.create(model=MODEL, prompt=[[1, 2], [3, 4]], max_tokens=2,
                                      n=3, temperature=1, seed=5)
            wait_for(lambda: app.state.service.sequences.in_use == 0, what="ids back")
            fams = families(httpx.get(f"{server.url}/metrics", timeout=10).text)
            # two prompts of n=3: two observations of 3, as vLLM's parent requests
            assert sample(fams, "vllm:request_params_n", "vllm:request_params_n_count") == 2
            assert sample(fams, "vllm:request_params_n", "vllm:request_params_n_sum") == 6
            assert sample(fams, "vllm:e2e_request_latency_seconds",
                          "vllm:e2e_request_latency_seconds_count") == 6
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("config", [{}, {"metrics_names": "calexec"}])
def test_without_the_option_no_vllm_name_is_exported(tmp_path, config):
    executor, app = served(tmp_path, **config)
    try:
        with LiveServer(app) as server:
            httpx.post(f"{server.url}/v1/completions", json={"prompt": [1], "max_tokens": 2},
                       timeout=30).raise_for_status()
            text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert "calexec_request_success_total" in text and "vllm:" not in text
    finally:
        executor.shutdown(5.0)


def test_an_unknown_metrics_names_value_is_refused():
    with pytest.raises(ValueError, match="metrics_names"):
        ServerConfig(metrics_names="prometheus")


def test_running_and_kv_gauges_while_requests_run_and_zero_after_they_end(tmp_path):
    """vLLM's test_abort_metrics_reset: running requests and KV usage show while they run
    and return to 0 once they ended (here by their deadline, mid-generation)."""
    executor = started_executor(tmp_path, "decode_us=20000")
    app = create_app(executor, ServerConfig(metrics_names="vllm"))
    try:
        with LiveServer(app) as server:
            def scrape() -> dict:
                return families(httpx.get(f"{server.url}/metrics", timeout=10).text)

            def gauge(fams: dict, name: str) -> float:
                return sample(fams, name, name, model_name=MODEL, engine="0")

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(httpx.post, f"{server.url}/v1/completions",
                                       json={"prompt": [1, 2, 3], "max_tokens": 1000,
                                             "timeout": 4}, timeout=30)
                           for _ in range(3)]
                wait_for(lambda: gauge(scrape(), "vllm:num_requests_running") == 3,
                         what="three requests running")
                fams = scrape()
                assert gauge(fams, "vllm:kv_cache_usage_perc") > 0
                assert gauge(fams, "vllm:num_requests_waiting") == 0
                assert [f.result().status_code for f in futures] == [504] * 3
            wait_for(lambda: app.state.service.sequences.in_use == 0, what="ids back")
            fams = scrape()
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                         "vllm:kv_cache_usage_perc"):
                assert gauge(fams, name) == 0, name
    finally:
        executor.shutdown(5.0)


def test_serve_takes_the_flag_and_refuses_an_unknown_value_naming_it(capsys):
    from calexec import serve
    with pytest.raises(SystemExit) as refused:  # argparse's own exit 2 for a bad choice
        serve.main(["serve", "--metrics-names", "foo"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--metrics-names" in err and "'foo'" in err
    assert serve.main(["serve", "--once", "--metrics-names", "vllm"]) == 0
