"""Stop 56, the server's probe: each defect pinned here (docs/traceability.md "Found at stop
56 (server)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import httpx
import pytest

from calexec.drivers.synthetic.calbin import MAX_SEQ, VOCAB
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
