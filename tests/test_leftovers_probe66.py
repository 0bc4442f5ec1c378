"""Stop 66, known defects left by earlier stops: each pinned here (docs/traceability.md "Found
at stop 66 (leftovers)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import json

import httpx
import pytest

from calexec.contracts.status import Status
from executor_harness import deadline, decode, prefill, running_executor, write_calbin
from test_server_support import live_fixture  # noqa: F401 - the fixture `live`

MODEL = "calexec-qwen3-synthetic"


# ---- 1. a tokenizer_config.json saved with a byte order mark ---------------------------------
def test_a_tokenizer_config_saved_with_a_byte_order_mark_is_read(tmp_path):
    """``calexec serve --tokenizer DIR`` whose ``tokenizer_config.json`` an editor saved with a
    UTF-8 byte order mark (Notepad's, after touching up the chat template) was refused at
    start, ``'DIR/tokenizer_config.json' is not readable JSON: Unexpected UTF-8 BOM (decode
    using utf-8-sig)``, where every other file calexec reads drops the mark (stop 65). The
    mark is dropped: the template and the special tokens are read as without it. So is one
    of ``tokenizer.json`` (the ``tokenizers`` library refused it, ``cannot load ... as a
    tokenizer.json: expected value at line 1 column 1``)."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    from tokenizers import models, pre_tokenizers

    from calexec.drivers.serving import hf_tokenizer
    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "<eos>": 6},
                                                unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    config = json.dumps({"chat_template": template, "eos_token": "<eos>"})
    (tmp_path / "tokenizer_config.json").write_bytes(b"\xef\xbb\xbf" + config.encode())
    loaded = hf_tokenizer.load(str(tmp_path))
    assert (loaded.chat_template, loaded.eos_token, loaded.eos_token_id) == (template, "<eos>", 6)
    tokenizer_json = tmp_path / "tokenizer.json"
    tokenizer_json.write_bytes(b"\xef\xbb\xbf" + tokenizer_json.read_bytes())
    loaded = hf_tokenizer.load(str(tmp_path))
    assert (loaded.encode("hello <eos>"), loaded.eos_token_id) == ([5, 6], 6)
    # a mark anywhere else is no encoding's: still refused, naming the file
    (tmp_path / "tokenizer_config.json").write_bytes(b"\xef\xbb\xbf\xef\xbb\xbf" + config.encode())
    with pytest.raises(hf_tokenizer.TokenizerLoadError, match="is not readable JSON"):
        hf_tokenizer.load(str(tmp_path))


# ---- 4. legacy completions' top_logprobs: two tokens of one text ------------------------------
def test_completions_top_logprobs_keep_the_more_likely_of_two_tokens_of_one_text(live):
    """``/v1/completions`` with ``logprobs: N`` answers ``top_logprobs`` as a map keyed by
    token text (OpenAI's shape): two tokens of one text, here the first bytes of ``é``,
    ``中`` and ``ж`` (each U+FFFD on its own), are one entry. It held the least likely one's
    logprob (a dict built over the tokens most likely first: each later one replaced the
    one before, as vLLM's does), so the sampled token's own entry was below its
    ``token_logprobs``; it now holds the most likely one's. The structured output allows
    only those three bytes after the opening quote, so they are that position's top 3."""
    server, _, _ = live
    schema = {"type": "object", "properties": {"w": {"type": "string",
                                                     "enum": ["é", "中", "ж"]}},
              "required": ["w"], "additionalProperties": False}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 12, "temperature": 0,
            "logprobs": 3,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "w", "schema": schema}}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    tokens, lps, tops = logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    at = next(i for i, t in enumerate(tokens) if t == "\ufffd")  # the character's first byte
    assert set(tops[at]) == {"\ufffd"}, tops[at]  # three tokens, one text
    for token, lp, top in zip(tokens, lps, tops):
        # the sampled token's text holds at least its own logprob (greedy: exactly)
        assert top[token] == lp, (token, lp, top)


# ---- 2. release_sequence beside an open stream never stepped (no defect: pinned) -------------
def _release_beside_an_unused_stream(calbin: str, api: str) -> list:
    """Seq 1 prefilled; a decode stream of it opened through ``api`` (none for ``enqueue``)
    and never stepped; ``release_sequence(1)``; another request takes the id with a longer
    prompt; then the stale step (on the stream, or an ``enqueue`` at the old ``past_len``)."""
    with running_executor(calbin) as ex:
        first = ex.enqueue(prefill(1, [1, 2, 3], kv_reserve_len=12)).wait_until(deadline())
        assert not isinstance(first, Status), first
        stream = None if api == "enqueue" else ex.decode_stream(
            1, first.kv_len, deadline(), max_len=12, greedy_ahead=api == "ahead")
        answers: list = [ex.release_sequence(1, 5.0).code, ex.snapshot().get("kv")]
        other = ex.enqueue(prefill(1, [5, 6, 7, 8, 9], kv_reserve_len=12)).wait_until(deadline())
        answers.append(other.code if isinstance(other, Status) else other.kv_len)
        if stream is None:
            after = ex.enqueue(decode(1, first.argmax, first.kv_len)).wait_until(deadline())
        else:
            submitted = stream.submit(first.argmax)
            after = submitted if isinstance(submitted, Status) else stream.wait()
            stream.close()
        answers.append(after.code if isinstance(after, Status) else after.kv_len)
        answers.append(ex.release_sequence(1, 5.0).code)
        return answers


def test_a_release_beside_an_open_stream_never_stepped_answers_as_the_plain_path(tmp_path):
    """``release_sequence`` of a sequence whose decode stream is open and was never stepped
    answers ``OK``, as the plain path (nothing open) does: the stream's armed first job is a
    guess, released before the KV reset, so no job holds KV the release gave back (spec §5);
    no KV is held after it. Refusing it (``kv.sequence_busy`` naming the stream) or closing
    the stream would answer otherwise than the plain path, which stop 57 made every path
    answer alike (tests/test_core_probe57.py). The stale step a caller sends afterwards is a
    request of the id at that moment, on every path: here a decode at the old ``past_len``
    on the KV of the request that took the id since (docs/embedding.md section 3)."""
    calbin = write_calbin(tmp_path)
    answers = {api: _release_beside_an_unused_stream(calbin, api)
               for api in ("enqueue", "stream", "ahead")}
    assert answers["enqueue"] == ["ok", None, 5, 4, "ok"], answers
    assert answers["stream"] == answers["ahead"] == answers["enqueue"], answers
