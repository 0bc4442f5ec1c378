"""Issue 27, real clients: EleutherAI's lm-evaluation-harness (``lm-eval``, the ``[eval]``
extra; it needs torch: ``.ci/clients`` installs the CPU wheel first), unmodified, with its
``local-completions`` model against a loopback server on the synthetic model, batch size 4
(a prompt list of token-id lists in each request).

Offline: the tasks are two tiny local ones (``tests/data/lmeval/``: lm-eval's ``json`` loader
on a local jsonl, HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set), and the tokenizer is the
server's own through lm-eval's ``tokenizer_backend=remote`` (vLLM's ``/tokenizer_info``,
``/tokenize``, ``/detokenize``), so nothing is downloaded.

- a generation task (``generate_until``): every answer is the numpy oracle's greedy
  continuation of the prompt;
- a likelihood task (``multiple_choice``, lm-eval sends ``echo`` with ``logprobs=1`` and
  ``max_tokens=1``): every choice's log-likelihood is the oracle's, within BF16->FP32
  rounding. lm-eval scores the continuation ``target_delimiter + choice`` (the task's
  delimiter, a space) after the question, each encoded on its own and concatenated; the
  oracle scores exactly that, and the test checks those are the pairs lm-eval asked for.
  Written to the OpenAI contract: it needs prompt logprobs (issue 27's echo-logprobs branch)
  and fails without them (``echo`` with ``logprobs`` is a 400 here).

Client timeout 10 s, one try (no retries)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.sampling import log_softmax
from calexec.drivers.synthetic import calbin, oracle
from needs import module
from test_server_support import MODEL, openai_server, oracle_tokens

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data" / "lmeval"
BATCH = 4
GEN_TOKENS = 4  # calexec_gen.yaml's max_gen_toks


lm_eval = module("lm_eval", "eval")


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """No hub: set before lm-eval imports ``datasets`` (it does so lazily, per evaluation)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
        yield


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=10.0) as (server, _, _):
        yield server.url


def _evaluate(url: str, task: str, monkeypatch) -> dict:
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(REPO)  # the task YAMLs name their jsonl relative to the repository
    return evaluator.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"{url}/v1/completions",
                    "tokenizer_backend": "remote", "max_retries": 1, "timeout": 10,
                    "max_length": 512},
        tasks=[task], batch_size=BATCH, log_samples=True,
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False))


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line]


def _target_delimiter() -> str:
    """The multiple-choice task's ``target_delimiter``: lm-eval puts it between the question
    and each choice."""
    import yaml  # lm-eval's own dependency

    config = yaml.safe_load((DATA / "calexec_mc.yaml").read_text())
    return str(config["target_delimiter"])


def _oracle_loglikelihood(context: list[int], continuation: list[int]) -> float:
    seq = oracle.OracleSequence(calbin.DEFAULT_SEED)
    seq.run(context)
    total = 0.0
    for token in continuation:
        row = oracle.bf16_to_f32(oracle.logits_bf16(seq.states[-1]))
        total += float(log_softmax(np.asarray(row, dtype=np.float32))[token])
        seq.run([token])
    return total


def test_generation_task_with_batches_answers_the_oracles_continuations(url,
                                                                         monkeypatch):
    results = _evaluate(url, "calexec_gen", monkeypatch)
    samples = results["samples"]["calexec_gen"]
    docs = _docs("gen.jsonl")
    assert len(samples) == len(docs)
    for sample in samples:
        prompt = docs[sample["doc_id"]]["prompt"]
        expected = tokenizer.decode(oracle_tokens(tokenizer.encode(prompt), GEN_TOKENS))
        assert sample["resps"][0][0] == expected, (prompt, sample["resps"])


def test_likelihood_task_with_batches_scores_every_choice_as_the_oracle(url,
                                                                        monkeypatch):
    results = _evaluate(url, "calexec_mc", monkeypatch)
    samples = results["samples"]["calexec_mc"]
    docs = _docs("mc.jsonl")
    delimiter = _target_delimiter()
    assert len(samples) == len(docs)
    for sample in samples:
        doc = docs[sample["doc_id"]]
        pairs = [(doc["question"], delimiter + choice) for choice in doc["choices"]]
        assert [tuple(args) for args in sample["arguments"]] == pairs, sample["arguments"]
        got = [resp[0][0] for resp in sample["resps"]]
        want = [_oracle_loglikelihood(tokenizer.encode(context), tokenizer.encode(continuation))
                for context, continuation in pairs]
        assert all(math.isfinite(g) for g in got), got
        assert got == pytest.approx(want, abs=1e-3), (doc, got, want)
    assert 0.0 <= results["results"]["calexec_mc"]["acc,none"] <= 1.0


def _local_completions(url: str, **model_args):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    return LocalCompletionsAPI(model=MODEL, base_url=f"{url}/v1/completions",
                               tokenizer_backend="remote", max_retries=1, timeout=10,
                               max_length=512, batch_size=BATCH, **model_args)


ROLLING_DOCS = ("hello world, this is a document", "another one")


def test_rolling_loglikelihood_with_the_end_tokens_id_as_prefix_is_the_oracles(url):
    """docs/server.md: lm-eval's rolling (perplexity) requests need
    ``custom_prefix_token_id=151643`` with the byte-level tokenizer; given it, every document's
    score (windows of the prefix id, then the document's tokens) is the oracle's, as is an
    empty context's loglikelihood."""
    from lm_eval.api.instance import Instance

    lm = _local_completions(url, custom_prefix_token_id=tokenizer.END_TOKEN_ID)
    got = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (doc,), i) for i, doc in enumerate(ROLLING_DOCS)])
    want = [_oracle_loglikelihood([tokenizer.END_TOKEN_ID], tokenizer.encode(doc))
            for doc in ROLLING_DOCS]
    assert got == pytest.approx(want, abs=1e-3)
    (empty, _), = lm.loglikelihood([Instance("loglikelihood", {}, ("", "hello"), 0)])
    assert empty == pytest.approx(_oracle_loglikelihood([tokenizer.END_TOKEN_ID],
                                                        tokenizer.encode("hello")), abs=1e-3)


def test_without_a_prefix_token_id_lm_eval_sends_null_which_is_refused_naming_prompt(url):
    """What docs/server.md says users meet without ``custom_prefix_token_id``: the
    byte-level tokenizer's special tokens have no text (``/tokenizer_info`` null), so lm-eval's
    remote tokenizer has no prefix id and sends ``None`` as each window's first token; the
    server refuses it (400, ``param: prompt``)."""
    import requests
    from lm_eval.api.instance import Instance

    lm = _local_completions(url)
    assert lm.prefix_token_id is None
    sent: list[dict] = []
    post = requests.post

    def spy(*args, **kwargs):
        sent.append(kwargs.get("json") or {})
        return post(*args, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(requests, "post", spy)
        with pytest.raises(Exception, match="400"):
            lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("abc",), 0)])
    assert sent and sent[0]["prompt"] == [[None, *tokenizer.encode("abc")]]
    answer = requests.post(f"{url}/v1/completions", json=sent[0], timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"


def test_chat_generate_until_stops_where_the_oracles_text_holds_a_stop_string(url):
    """``local-chat-completions`` (``generate_until``, one request a time): lm-eval sends
    ``until`` as ``stop`` (its first four) and ``max_gen_toks`` as ``max_tokens``, and takes
    the message's content as the answer. Each answer is the oracle's greedy continuation of
    the chat's prompt (the server's own ``/tokenize`` of the messages), cut before the first
    stop string, one spanning two tokens' text too; none matching: ``max_gen_toks`` tokens."""
    import requests
    from lm_eval.api.instance import Instance
    from lm_eval.models.api_models import JsonChatStr
    from lm_eval.models.openai_completions import LocalChatCompletion

    messages = [{"role": "user", "content": "Once upon a time"}]
    prompt = requests.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages,
                                                    "add_generation_prompt": True},
                           timeout=10).json()["tokens"]
    full = tokenizer.decode(oracle_tokens(prompt, 6))
    boundary = full.index(">")
    spanning = full[boundary - 1:boundary + 3]  # the end of one token's text, the next's start
    lm = LocalChatCompletion(model=MODEL, base_url=f"{url}/v1/chat/completions",
                             max_retries=1, timeout=10)
    asked = [{"until": [spanning], "max_gen_toks": 6}, {"until": ["\u00ff\u00fe"],
                                                        "max_gen_toks": 3},
             {"until": "<", "max_gen_toks": 6}]
    answers = lm.generate_until([
        Instance("generate_until", {}, (JsonChatStr(json.dumps(messages)), kwargs), i)
        for i, kwargs in enumerate(asked)])
    assert answers == [full.split(spanning)[0], tokenizer.decode(oracle_tokens(prompt, 3)),
                       ""], (full, answers)


def test_a_context_lm_eval_left_truncates_is_scored_as_the_oracle_scores_what_was_sent(url):
    """A context longer than lm-eval's ``max_length`` is left-truncated by lm-eval (its
    window, not the server's), batched with one that fits: each score is the oracle's of the
    tokens lm-eval sent, the continuation after the truncated context."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(model=MODEL, base_url=f"{url}/v1/completions",
                             tokenizer_backend="remote", max_retries=1, timeout=10,
                             max_length=17, batch_size=BATCH)  # it keeps 17 - 1 = 16 tokens
    pairs = [("The quick brown fox jumps over the lazy dog", " again"), ("hi", " there")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i)
                            for i, pair in enumerate(pairs)])
    for (context, continuation), (score, _) in zip(pairs, got):
        sent = (tokenizer.encode(context) + tokenizer.encode(continuation))[-16:]
        kept = len(sent) - len(tokenizer.encode(continuation))
        assert score == pytest.approx(_oracle_loglikelihood(sent[:kept], sent[kept:]),
                                      abs=1e-3), (context, score)


def _oracle_greedy(context: list[int], continuation: list[int]) -> bool:
    """Whether every continuation token is the oracle's most likely next token."""
    return oracle_tokens(context, len(continuation)) == continuation


@pytest.mark.parametrize(("tokenized", "concurrent"), [(True, 1), (False, 2)])
def test_loglikelihood_says_greedy_as_the_oracle_with_strings_and_concurrent_requests(
        url, tokenized, concurrent):
    """(Not a defect: pins what held.) lm-eval's second loglikelihood value, ``is_greedy``
    (each continuation token's logprob equal to its position's most likely one, with
    ``logprobs: 1``; lambada-style tasks score it), is the oracle's: ``"q1584"`` continues
    greedily with ``"o"``, ``"q419"`` with the byte 0x8D, which ``"é"``'s first byte (0xC3,
    also shown as U+FFFD on its own) is not. Prompts sent as token lists
    (``tokenized_requests``) or as strings, batched, one request at a time or concurrent
    (lm-eval's aiohttp path, ``num_concurrent``)."""
    from lm_eval.api.instance import Instance

    lm = _local_completions(url, tokenized_requests=tokenized, num_concurrent=concurrent)
    pairs = [("q1584", "o"), ("q419", "\u00e9"), ("q1584", " x"), ("hello", "!")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i)
                            for i, pair in enumerate(pairs)])
    want = [(_oracle_loglikelihood(tokenizer.encode(c), tokenizer.encode(x)),
             _oracle_greedy(tokenizer.encode(c), tokenizer.encode(x))) for c, x in pairs]
    assert [greedy for _, greedy in got] == [greedy for _, greedy in want] == [
        True, False, False, False]
    assert [score for score, _ in got] == pytest.approx([score for score, _ in want],
                                                         abs=1e-3)


def test_sampled_generations_do_not_depend_on_the_batch_size(url):
    """lm-eval's ``generate_until`` with ``do_sample`` and a temperature sends ``seed: 1234``
    with each batch as one prompt list. A prompt's choice drew with a seed derived from its
    index across the list, so its answer depended on ``batch_size`` and on its place in the
    batch (batch size 1 and 4 answered differently), where vLLM seeds each prompt alike. Now
    a prompt draws the same in a batch as alone, and the prompts of a batch still differ."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    contexts = ["Once", "upon", "a time", "there"]
    asked = {"until": ["\n\n"], "max_gen_toks": 4, "do_sample": True, "temperature": 1.0}
    answers = []
    for batch in (1, len(contexts)):
        lm = LocalCompletionsAPI(model=MODEL, base_url=f"{url}/v1/completions",
                                 tokenizer_backend="remote", max_retries=1, timeout=10,
                                 max_length=512, batch_size=batch)
        answers.append(lm.generate_until([
            Instance("generate_until", {}, (context, dict(asked)), i)
            for i, context in enumerate(contexts)]))
    alone, batched = answers
    assert batched == alone
    assert len(set(alone)) == len(contexts)
