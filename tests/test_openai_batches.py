"""Issue 27, batches and n: a completion prompt list (strings, token lists; one element too)
answers one choice per prompt, ``n`` choices per prompt (completions and chat, streamed or
not), ``index = prompt_i * n + j`` as OpenAI sets it, ``usage`` summed (prompt tokens once per
prompt, as OpenAI and vLLM count them); seeded choices are reproducible and distinct, greedy
ones identical; a cap on prompts x n; fair admission (a request's choices run through the
same admission as separate requests, at most half the sequence ids at once); one failed
choice fails the request and everything it held comes back.

The ``openai`` SDK against a loopback in-process server (as tests/test_openai_api.py); faults
through the emulator's fault points (as tests/test_server_resume.py). Every wait is bounded.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from calexec.drivers.calrt.runtime import Fault, FaultMode
from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.tools.chaos import FAULTS
from test_server_support import (
    LiveServer,
    live_fixture,  # noqa: F401 - the fixture `live`
    openai_server,
    oracle_tokens,
    started_executor,
    wait_for,
)

MODEL = "calexec-qwen3-synthetic"


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def _sse(response: httpx.Response) -> tuple[list[dict], int]:
    """The events of a stream and how many ``[DONE]`` it carried."""
    events, done = [], 0
    for line in response.iter_lines():
        if not line:
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done += 1
        else:
            events.append(json.loads(data))
    return events, done


# ---- prompt lists ---------------------------------------------------------------------------
def test_a_prompt_list_answers_one_choice_per_prompt_in_order(live):
    _, client, _ = live
    prompts = ["a", "bc", "xyz"]
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4)
    assert [c.index for c in done.choices] == [0, 1, 2]
    for i, prompt in enumerate(prompts):
        single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert done.choices[i].text == single.choices[0].text
        assert done.choices[i].finish_reason == "length"
        assert _ids(done.choices[i]) == oracle_tokens(tokenizer.encode(prompt), 4)
    assert done.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert done.usage.completion_tokens == 12
    assert done.usage.total_tokens == done.usage.prompt_tokens + 12


def test_a_one_element_list_and_token_list_prompts(live):
    _, client, _ = live
    one = client.completions.create(model=MODEL, prompt=["hi"], max_tokens=3)
    assert len(one.choices) == 1 and one.choices[0].index == 0
    assert _ids(one.choices[0]) == oracle_tokens(tokenizer.encode("hi"), 3)
    batch = client.completions.create(model=MODEL, prompt=[[1, 2], [3, 4, 5]], max_tokens=3)
    assert [_ids(c) for c in batch.choices] == [oracle_tokens([1, 2], 3),
                                                oracle_tokens([3, 4, 5], 3)]
    assert batch.usage.prompt_tokens == 5
    flat = client.completions.create(model=MODEL, prompt=[7, 8], max_tokens=2)  # one prompt
    assert len(flat.choices) == 1 and _ids(flat.choices[0]) == oracle_tokens([7, 8], 2)


def test_each_choice_has_its_own_logprobs_and_echo(live):
    _, client, _ = live
    done = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=2,
                                     logprobs=2, echo=False)
    for choice in done.choices:
        assert len(choice.logprobs.tokens) == 2 and len(choice.logprobs.top_logprobs) == 2
        assert choice.logprobs.text_offset[0] == 0
    echoed = client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=1,
                                       echo=True)
    assert [c.text[:2] for c in echoed.choices] == ["ab", "cd"]


# ---- n ------------------------------------------------------------------------------------
def test_n_with_a_prompt_list_sets_index_prompt_times_n_plus_j(live):
    _, client, _ = live
    prompts = [[11, 12], [13, 14, 15]]
    done = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    for choice in done.choices:  # greedy: every choice of a prompt is the oracle's
        assert _ids(choice) == oracle_tokens(prompts[choice.index // 2], 3)
    # prompt tokens once per prompt, completion tokens of every choice
    assert done.usage.prompt_tokens == 5 and done.usage.completion_tokens == 12


def test_sampled_choices_differ_and_a_seed_reproduces_them(live):
    _, client, _ = live
    body = dict(model=MODEL, prompt=[31, 32, 33], max_tokens=8, temperature=1.0, n=4)
    first = [_ids(c) for c in client.completions.create(seed=99, **body).choices]
    assert len({tuple(t) for t in first}) > 1  # distinct draws per choice
    again = [_ids(c) for c in client.completions.create(seed=99, **body).choices]
    assert again == first
    # choice 0 keeps the request's seed: it is what n=1 draws with that seed
    single = client.completions.create(model=MODEL, prompt=[31, 32, 33], max_tokens=8,
                                       temperature=1.0, seed=99)
    assert _ids(single.choices[0]) == first[0]


def test_chat_n_greedy_choices_are_identical_streamed_or_not(live):
    server, client, _ = live
    messages = [{"role": "user", "content": "hi"}]
    done = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=4)
    assert [c.index for c in done.choices] == [0, 1, 2]
    expected = tokenizer.decode(oracle_tokens(tokenizer.encode("user: hi\nassistant:"), 4))
    assert [c.message.content for c in done.choices] == [expected] * 3
    assert done.usage.prompt_tokens == len(tokenizer.encode("user: hi\nassistant:"))
    assert done.usage.completion_tokens == 12
    with httpx.Client(base_url=server.url, timeout=60) as http, http.stream(
            "POST", "/v1/chat/completions",
            json={"messages": messages, "n": 3, "max_tokens": 4, "stream": True,
                  "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events, dones = _sse(r)
    assert dones == 1
    texts: dict[int, str] = {}
    roles, finishes = set(), {}
    for event in events[:-1]:
        assert len(event["choices"]) == 1 and event["id"] == events[0]["id"]
        choice = event["choices"][0]
        if choice["delta"].get("role"):
            roles.add(choice["index"])
        texts[choice["index"]] = texts.get(choice["index"], "") + \
            (choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert roles == {0, 1, 2} and texts == {0: expected, 1: expected, 2: expected}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_a_completion_stream_of_prompts_and_n_carries_each_index_and_one_done(live):
    server, client, service = live
    prompts = [[21, 22], [23, 24, 25]]
    whole = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3,
                                      temperature=0.8, seed=5)
    with httpx.Client(base_url=server.url, timeout=60) as http, http.stream(
            "POST", "/v1/completions",
            json={"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0.8, "seed": 5,
                  "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events, dones = _sse(r)
    assert dones == 1
    streamed: dict[int, list[int]] = {}
    for event in events[:-1]:
        choice = event["choices"][0]
        streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert streamed == {c.index: _ids(c) for c in whole.choices}
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 12,
                                   "total_tokens": 17}
    # without include_usage no chunk carries usage
    with httpx.Client(base_url=server.url, timeout=60) as http, http.stream(
            "POST", "/v1/completions",
            json={"prompt": prompts, "max_tokens": 2, "stream": True}) as r:
        plain, dones = _sse(r)
    assert dones == 1 and all("usage" not in e or e["usage"] is None for e in plain)
    wait_for(lambda: service.sequences.in_use == 0, what="every id back after the streams")


# ---- cap and fairness -----------------------------------------------------------------------
#: the cap the tests below set (the default, service.DEFAULT_MAX_CHOICES, is 128)
CAP = 16


@pytest.fixture(scope="module", name="capped")
def capped_fixture(tmp_path_factory):
    """``openai_server`` with ``max_choices`` set to :data:`CAP`: ``(server, client, service)``."""
    with openai_server(tmp_path_factory.mktemp("capped"), ServerConfig(max_choices=CAP)) as s:
        yield s


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [1, 2], "n": 17}, "n"),
    ({"prompt": [[1]] * 5, "n": 4}, "n"),
    ({"prompt": ["a"] * 17}, "prompt"),
    ({"prompt": [1, 2], "n": 0}, "n")])
def test_prompts_times_n_above_the_cap_is_a_400_naming_it(capped, body, param):
    server, _, _ = capped
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    if body.get("n") != 0:
        assert f"max_choices={CAP}" in error["message"], error


@pytest.mark.parametrize("body", [{"prompt": [1, 2], "n": 16}, {"prompt": [[1]] * 4, "n": 4},
                                  {"prompt": ["a"] * 16}])
def test_exactly_max_choices_is_served(capped, body):
    """The cap is inclusive: prompts x n = max_choices (16) is served, one above is a 400."""
    server, _, _ = capped
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == list(range(CAP))


def test_chat_n_above_the_cap_is_a_400_naming_n(capped):
    _, client, _ = capped
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       n=CAP + 1, max_tokens=1)
    assert err.value.body["param"] == "n" and f"max_choices={CAP}" in err.value.body["message"]


def test_a_request_takes_at_most_half_the_sequence_ids_and_its_other_choices_wait(tmp_path):
    """4 sequence ids and no waiting queue (max_waiting=0: one more request is refused at
    once): 8 choices admitted together would find no id for 4 of them; run 2 at a time, all
    8 are served, one request's worth of ids is left for others."""
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(max_sequences=4, max_waiting=0))
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                   timeout=60)
            done = client.completions.create(model=MODEL, prompt=[1, 2, 3], n=8, max_tokens=3)
            assert [c.index for c in done.choices] == list(range(8))
            assert all(_ids(c) == oracle_tokens([1, 2, 3], 3) for c in done.choices)
            service = app.state.service
            wait_for(lambda: service.sequences.in_use == 0, what="every id back")
            assert service.sequences.consistent() and service.sequences.withheld == 0
    finally:
        executor.shutdown(5.0)


# ---- one failed choice ----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_one_failed_choice_fails_the_request_and_releases_everything(tmp_path, stream):
    """No resumes: the CCU exception injected into the 3rd job fails the choice running it;
    the request answers that error (vLLM's behaviour) and every sequence id comes back."""
    # (the default execution deadline: no job hangs here, and with no resumes a healthy job
    # a loaded host held past a short one failed a request the test expects to succeed)
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(max_resumes=0))
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            _, point, rc = next(f for f in FAULTS if f[0] == "ccu_exception")
            assert executor.device.emu.set_fault(Fault[point], FaultMode.NTH, 3, 0, rc) == 0
            body = {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 6, "stream": stream}
            with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 200:  # streamed: the error goes in-band, no [DONE]
                    assert stream
                    events, dones = _sse(r)
                    assert dones == 0 and "error" in events[-1], events[-1]
                else:
                    r.read()
                    assert "error" in r.json() and r.status_code >= 500, r.text
            executor.device.emu.clear_all_faults()
            service = app.state.service
            wait_for(lambda: service.sequences.in_use == 0 and service.active == 0,
                     what="every id and run released")
            assert service.sequences.consistent() and service.sequences.withheld == 0
            # the server serves again
            ok = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "n": 2})
            assert ok.status_code == 200, ok.text
    finally:
        executor.shutdown(5.0)
