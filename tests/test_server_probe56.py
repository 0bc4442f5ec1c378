"""Stop 56, the server's probe: each defect pinned here (docs/traceability.md "Found at stop
56 (server)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import httpx
import pytest

from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.synthetic.calbin import MAX_SEQ, VOCAB
from test_server_support import LiveServer, started_executor
from test_server_support import live_fixture  # noqa: F401 - the fixture `live`

MODEL = "calexec-qwen3-synthetic"
CHAT = {"messages": [{"role": "user", "content": "hello"}]}
PROMPT = {"prompt": [300, 301, 302]}


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("keep", [MAX_SEQ + 1, 10**30], ids=["context+1", "huge"])
def test_truncate_prompt_tokens_above_the_context_is_a_400_naming_it_and_the_limit(
        live, route, keep):
    """``truncate_prompt_tokens`` above the model's context (``max_model_len``) was taken
    and truncated nothing: a client sizing it to a model it thought larger got its long
    prompt refused for its length (or a short one served) with no word about the field.
    vLLM refuses it ("truncate_prompt_tokens value is greater than max_model_len"); both
    routes now answer a 400 naming the field, the value and the limit."""
    server, _, _ = live
    body = {"model": MODEL, "max_tokens": 1, "truncate_prompt_tokens": keep,
            **(PROMPT if route == "completions" else CHAT)}
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "truncate_prompt_tokens", error
    assert f"truncate_prompt_tokens={keep}" in error["message"], error
    assert f"max_model_len={MAX_SEQ}" in error["message"], error


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_truncate_prompt_tokens_of_the_whole_context_is_still_taken(live, route):
    server, _, _ = live
    body = {"model": MODEL, "max_tokens": 1, "truncate_prompt_tokens": MAX_SEQ,
            **(PROMPT if route == "completions" else CHAT)}
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_top_k_at_or_above_the_vocabulary_samples_as_top_k_off(live, route):
    """``top_k`` has no upper bound (docs/server.md's table, as vLLM, which clamps it to the
    vocabulary): a k of the vocabulary's size or any larger integer keeps every token, so a
    seeded draw is the draw with top-k off, on both routes."""
    server, _, _ = live
    base = {"model": MODEL, "max_tokens": 6, "temperature": 1.5, "seed": 7,
            **(PROMPT if route == "completions" else CHAT)}

    def drawn(top_k: int) -> list[int]:
        r = httpx.post(f"{server.url}/v1/{route}", json={**base, "top_k": top_k}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    off = drawn(-1)
    assert drawn(VOCAB) == off and drawn(10**30) == off
    assert drawn(VOCAB - 1) != off or drawn(2) != off  # (a real k does cut: the draw can see it)


@pytest.mark.parametrize("decoder", [None, "WordPiece"])
def test_a_tokenizer_llguidance_cannot_load_makes_structured_fields_a_400_naming_them(
        tmp_path, decoder):
    """``--tokenizer`` takes any ``tokenizer.json`` the ``tokenizers`` library loads, but
    llguidance builds a grammar's vocabulary only from one whose decoder is ByteLevel or
    Metaspace: with a WordPiece decoder (or none) every request with ``response_format``
    (json types) or ``tools`` was a 500 ``server.unexpected_error`` (ValueError "can't
    determine decoder type", the tokenizer read again each time). It is now a 400 naming the
    field and llguidance's reason, as when llguidance is not installed; text requests are
    served as before."""
    pytest.importorskip("llguidance")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.WordLevel(
        {"[UNK]": 0, "hello": 5, "user": 6, ":": 7, "assistant": 8, "{": 9, "}": 10},
        unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if decoder is not None:
        tok.decoder = getattr(decoders, decoder)()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(tokenizer_path=str(path)))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    asks = [("completions", {"prompt": "hello", "response_format": {"type": "json_object"}},
             "response_format"),
            ("chat/completions", {**CHAT, "response_format": {"type": "json_object"}},
             "response_format"),
            ("chat/completions", {**CHAT, "tools": [tool], "tool_choice": "required"}, "tools")]
    try:
        with LiveServer(app) as server:
            for _ in range(2):  # (the second time from the kept refusal)
                for route, body, param in asks:
                    r = httpx.post(f"{server.url}/v1/{route}",
                                   json={"model": MODEL, "max_tokens": 2, **body}, timeout=30)
                    assert r.status_code == 400, (route, r.text)
                    error = r.json()["error"]
                    assert error["param"] == param, error
                    assert "llguidance cannot load" in error["message"], error
                    assert str(path) in error["message"], error
            r = httpx.post(f"{server.url}/v1/completions",
                           json={"model": MODEL, "max_tokens": 2, "prompt": "hello"}, timeout=30)
            assert r.status_code == 200, r.text
    finally:
        executor.shutdown(5.0)
