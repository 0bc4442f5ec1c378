"""Issue 27, prompt logprobs: completions' ``echo`` with ``logprobs`` (``max_tokens`` 0 and
prompt lists too, as evaluation harnesses such as lm-eval's ``local-completions`` send them
for loglikelihood tasks) and vLLM's ``prompt_logprobs``. The executor feeds the prompt one
token per job (a one-token prefill, then a decode step per prompt token, through the plain
``enqueue`` path) and keeps every position's row: each prompt token's logprob must equal
the numpy oracle's log-softmax of the row before it, for random prompts; the generated tokens
after it must still be the oracle's greedy ones (the KV bookkeeping stayed right); a deadline
or a device fault in the middle of the prompt gives back everything the request held.

The ``openai`` SDK (and httpx for the stream) against a loopback in-process server on the
bundled emulator (zero-latency profile). Every wait is bounded.
"""

from __future__ import annotations

import json
import math

import httpx
import numpy as np
import openai
import pytest

from calexec.drivers.calrt.runtime import Fault, FaultMode
from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.synthetic import calbin, oracle
from calexec.drivers.tools.chaos import FAULTS
from calexec.machines.faults import RecoveryPolicy
from test_server_support import LiveServer, metric_value, oracle_tokens, started_executor, wait_for

MODEL = "calexec-qwen3-synthetic"
TOK = tokenizer.ByteTokenizer()
TOL = 1e-5  # FP32: the emulator's row is the oracle's BF16 row widened, log-softmax in float64


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    # always the pre-armed decode stream for generated tokens, even on this zero-latency
    # device (ServerConfig.prearm_min_device_ms): which jobs take it is what one test checks
    app = create_app(executor, ServerConfig(prearm_min_device_ms=0.0))
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        yield server, client, app.state.service
    executor.shutdown(5.0)


def oracle_rows(prompt: list[int]) -> list[np.ndarray]:
    """The oracle's log-softmax row after each prompt prefix prompt[:k+1] (float64)."""
    seq = oracle.OracleSequence(calbin.DEFAULT_SEED)
    rows = []
    for token in prompt:
        seq.run([token])
        row = oracle.bf16_to_f32(oracle.logits_bf16(seq.states[-1])).astype(np.float64)
        rows.append(row - row.max() - math.log(np.exp(row - row.max()).sum()))
    return rows


def random_prompts(seed: int, count: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, calbin.VOCAB, int(rng.integers(2, 13)))]
            for _ in range(count)]


def check_top(got: dict[str, float], row: np.ndarray, top: int, token: int) -> None:
    """``got`` (text -> logprob) is a ``top`` most likely set of ``row`` (ties: any of them)
    and ``token``, the position's own token, as OpenAI ("the API will always return the
    logprob of the sampled token", up to ``top`` + 1 entries) and vLLM answer: ``top`` 0 is
    that token alone."""
    text = TOK.token_text(token)
    assert text in got and got[text] == pytest.approx(row[token], abs=TOL)
    best = np.sort(row)[::-1][:top]
    others = dict(got)
    if len(got) == top + 1 or top == 0:
        del others[text]  # the token is not among the top ones (top 0: nothing else)
    assert len(others) == top, (got, top)
    for name, value in others.items():  # the byte tokenizer's ids >= 512 print as <id>
        assert name.startswith("<") and value == pytest.approx(row[int(name[1:-1])], abs=TOL)
    assert sorted(others.values(), reverse=True) == pytest.approx(list(best), abs=TOL)


def check_prompt_part(lp, prompt: list[int], top: int) -> None:
    """``lp`` (a completion's logprobs) starts with the prompt's entries, equal to the oracle's."""
    rows = oracle_rows(prompt)
    texts = [TOK.token_text(t) for t in prompt]
    assert lp.tokens[:len(prompt)] == texts
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:len(prompt)] == [sum(len(t) for t in texts[:i])
                                            for i in range(len(prompt))]
    for k in range(1, len(prompt)):
        row = rows[k - 1]  # the distribution of prompt[k]
        assert lp.token_logprobs[k] == pytest.approx(row[prompt[k]], abs=TOL)
        check_top(lp.top_logprobs[k], row, top, prompt[k])


def test_echo_logprobs_max_tokens_0_equal_the_oracle_for_random_prompts(live):
    _, client, service = live
    for prompt in random_prompts(27, 6):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                         logprobs=3)
        choice = done.choices[0]
        assert choice.text == tokenizer.decode(prompt)
        assert choice.finish_reason == "length" and choice.model_extra["token_ids"] == []
        assert len(choice.logprobs.tokens) == len(prompt)
        check_prompt_part(choice.logprobs, prompt, 3)
        assert done.usage.prompt_tokens == len(prompt) and done.usage.completion_tokens == 0
    wait_for(lambda: service.sequences.in_use == 0, what="every id back")
    assert service.sequences.consistent() and service.sequences.withheld == 0


def test_echo_logprobs_0_carry_each_prompt_token_alone(live):
    """``logprobs: 0`` with ``echo``: every prompt position's ``top_logprobs`` is its own
    token and nothing else (vLLM's ``test_echo_logprob_completion[0]`` wants 1 entry; the
    generated tokens already carried theirs)."""
    _, client, _ = live
    prompt = random_prompts(3, 1)[0]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                     logprobs=0)
    lp = done.choices[0].logprobs
    check_prompt_part(lp, prompt, 0)
    assert [len(top) for top in lp.top_logprobs[1:]] == [1] * (len(prompt) + 1)


def test_echo_logprobs_then_generated_tokens_are_the_oracle_s(live):
    """After the prompt was fed one token per job, the generation goes on from the right KV:
    the greedy tokens and their logprobs are the oracle's, offsets continue after the prompt."""
    _, client, _ = live
    prompt = random_prompts(5, 1)[0]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True,
                                     logprobs=1)
    choice = done.choices[0]
    expected = oracle_tokens(prompt, 4)
    assert choice.model_extra["token_ids"] == expected
    assert choice.text == tokenizer.decode(prompt) + tokenizer.decode(expected)
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 4
    check_prompt_part(lp, prompt, 1)
    rows = oracle_rows(prompt + expected)
    for i, token in enumerate(expected):
        assert lp.token_logprobs[len(prompt) + i] == pytest.approx(
            rows[len(prompt) - 1 + i][token], abs=TOL)
    texts = lp.tokens
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    # the same request without echo: the same generated part
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, logprobs=1)
    assert plain.choices[0].logprobs.token_logprobs == lp.token_logprobs[len(prompt):]


def test_a_prompt_list_as_lm_eval_sends_it(live):
    """lm-eval ``local-completions`` loglikelihood: a batch of prompts, echo, logprobs 1,
    max_tokens 1 (its request), temperature 0: one choice per prompt, each correct."""
    _, client, _ = live
    prompts = random_prompts(11, 4)
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, echo=True,
                                     logprobs=1, temperature=0, seed=1234)
    assert [c.index for c in done.choices] == list(range(len(prompts)))
    for prompt, choice in zip(prompts, done.choices):
        assert choice.model_extra["token_ids"] == oracle_tokens(prompt, 1)
        check_prompt_part(choice.logprobs, prompt, 1)
    assert done.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_a_streamed_echo_carries_the_prompt_logprobs_first(live):
    server, client, _ = live
    prompt = random_prompts(9, 1)[0]
    body = {"prompt": prompt, "max_tokens": 3, "echo": True, "logprobs": 2}
    whole = client.completions.create(model=MODEL, **body).choices[0].logprobs
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    text = ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            text += choice["text"]
            for key in merged:
                merged[key] += (choice["logprobs"] or {}).get(key, [])
    assert text.startswith(tokenizer.decode(prompt))
    assert merged["tokens"] == whole.tokens and merged["text_offset"] == whole.text_offset
    assert merged["token_logprobs"] == whole.token_logprobs
    assert merged["top_logprobs"] == whole.top_logprobs


def test_echo_without_logprobs_echoes_the_text_and_max_tokens_0_generates_nothing(live):
    _, client, _ = live
    done = client.completions.create(model=MODEL, prompt="hello", max_tokens=0, echo=True)
    assert done.choices[0].text == "hello" and done.choices[0].logprobs is None
    assert done.usage.completion_tokens == 0
    # chat keeps max_tokens >= 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, max_tokens=0,
                                       messages=[{"role": "user", "content": "hi"}])


def test_vllm_prompt_logprobs(live):
    _, client, _ = live
    prompt = random_prompts(3, 1)[0]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                     extra_body={"prompt_logprobs": 2})
    choice = done.choices[0]
    assert choice.logprobs is None  # not asked for
    assert choice.model_extra["token_ids"] == oracle_tokens(prompt, 2)
    entries = choice.model_extra["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    rows = oracle_rows(prompt)
    for k in range(1, len(prompt)):
        row, entry = rows[k - 1], entries[k]
        mine = entry[str(prompt[k])]
        assert mine["logprob"] == pytest.approx(row[prompt[k]], abs=TOL)
        assert mine["rank"] == 1 + int(np.count_nonzero(row > row[prompt[k]]))
        assert mine["decoded_token"] == TOK.token_text(prompt[k])
        others = {int(t): v for t, v in entry.items() if int(t) != prompt[k]}
        assert len(entry) in (2, 3)  # the top 2, and the prompt token unless among them
        for t, v in others.items():
            assert v["logprob"] == pytest.approx(row[t], abs=TOL)
            assert v["rank"] in (1, 2) and v["decoded_token"] == TOK.token_text(t)
            assert int(np.count_nonzero(row > row[t])) < 2  # truly among the 2 most likely
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"prompt_logprobs": 21})
    assert refused.value.body["param"] == "prompt_logprobs"


def test_a_deadline_in_the_middle_of_the_prompt_releases_everything(live):
    _, client, service = live
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, calbin.VOCAB, 4000)]
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                  logprobs=0, extra_body={"timeout": 0.05})
    assert failed.value.status_code == 504
    wait_for(lambda: service.sequences.in_use == 0 and not service.live_requests(),
             what="the sequence released after the deadline")
    assert service.sequences.consistent() and service.sequences.withheld == 0
    # and the next request is served from a clean state
    prompt = random_prompts(2, 1)[0]
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                     logprobs=1)
    check_prompt_part(done.choices[0].logprobs, prompt, 1)


def test_a_device_fault_in_the_middle_of_the_prompt_resumes_with_identical_rows(tmp_path):
    """A CCU exception on the 5th job (a decode feeding a prompt token): the request resumes on
    a fresh sequence, re-prefilling the prompt up to the failed position, and answers exactly
    the fault-free rows and tokens; every id comes back. (The default execution deadline:
    no job hangs here, and a healthy job a loaded host held past a short one was one more
    fault, resumed.)"""
    executor = started_executor(tmp_path,
                                recovery=RecoveryPolicy(max_recoveries=1000,
                                                        drain_grace_s=1.0))
    app = create_app(executor, ServerConfig())
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                   max_retries=0, timeout=60)
            _, point, rc = next(f for f in FAULTS if f[0] == "ccu_exception")
            for name in point.split("+"):
                assert executor.device.emu.set_fault(Fault[name], FaultMode.NTH, 5, 0, rc) == 0
            prompt = random_prompts(8, 1)[0] + [7, 8, 9, 10]
            done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                             echo=True, logprobs=2, extra_body={"timeout": 20})
            executor.device.emu.clear_all_faults()
            check_prompt_part(done.choices[0].logprobs, prompt, 2)
            assert done.choices[0].model_extra["token_ids"] == oracle_tokens(prompt, 3)
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            assert (metric_value(metrics, "calexec_resumes_total") or 0) >= 1
            service = app.state.service
            wait_for(lambda: service.sequences.in_use == 0, what="every id back")
            assert service.sequences.consistent() and service.sequences.withheld == 0
    finally:
        executor.shutdown(5.0)


def test_the_prompt_goes_through_the_plain_path_only(live):
    """The prompt jobs are the executor's plain ``enqueue`` (the differential harness's
    reference path), never the pre-armed decode stream or greedy ahead: of P + M - 1 jobs
    (a one-token prefill, P - 1 prompt decodes, M - 1 generated decodes) only the M - 1
    generated steps go through the decode stream."""
    server, client, service = live

    def counts() -> tuple[float, float]:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        steps = sum(metric_value(text, "calexec_decode_steps_total", {"prearmed": p}) or 0
                    for p in ("true", "false"))
        return steps, metric_value(text, "calexec_executor_jobs_total",
                                   {"outcome": "submitted"}) or 0

    wait_for(lambda: service.sequences.in_use == 0, what="a quiet server")
    prompt, m = random_prompts(4, 1)[0] + [1, 2, 3], 5
    steps, jobs = counts()
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=m, echo=True,
                                     logprobs=0, extra_body={"ignore_eos": True})
    assert done.choices[0].model_extra["token_ids"] == oracle_tokens(prompt, m)
    wait_for(lambda: service.sequences.in_use == 0, what="the request released")
    steps_after, jobs_after = counts()
    assert steps_after - steps == m - 1
    assert jobs_after - jobs == len(prompt) + m - 1
