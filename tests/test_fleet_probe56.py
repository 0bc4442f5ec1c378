"""Found at stop 56 (fleet, admin, debug and server leftovers): each test names what a user
hit before its fix."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from calexec.drivers.serving import byte_tokenizer
from calexec.drivers.serving.service import MAX_CHOICES, ServerConfig
from test_server_support import openai_server


def test_serve_refuses_a_max_choices_past_its_bound_naming_flag_value_and_range():
    """``serve --max-choices 100000000000`` was taken: one request with a huge ``n`` then set
    up that many choices (an admission, a task, a held answer each) and exhausted memory.
    Refused now in one line naming the flag, the value and the range (exit 2)."""
    proc = subprocess.run([sys.executable, "-m", "calexec", "serve", "--once",
                           "--max-choices", str(10 ** 11)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--max-choices" in proc.stderr and str(10 ** 11) in proc.stderr
    assert f"1..{MAX_CHOICES}" in proc.stderr


def test_a_server_config_refuses_a_max_choices_past_its_bound():
    """The embedder's way to the same cap (``ServerConfig``, a Ray replica's settings)."""
    with pytest.raises(ValueError, match=rf"^max_choices={10 ** 11}: must be .*<= "
                                         rf"{MAX_CHOICES}"):
        ServerConfig(max_choices=10 ** 11)
    assert ServerConfig(max_choices=MAX_CHOICES).max_choices == MAX_CHOICES  # (the bound)


@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["byte-level", "tokenizer-json"])
def test_detokenize_refuses_an_id_outside_the_vocabulary_with_either_tokenizer(
        tmp_path, with_tokenizer):
    """``POST /detokenize {"tokens": [..., 200000]}`` (the synthetic model's vocabulary is
    151,936 ids): with a ``--tokenizer`` the id was dropped silently (200 and a text missing a
    piece), with the byte-level tokenizer it printed ``<200000>``: the same ids read two
    ways, neither saying the id is no token. Both are a 400 naming ``tokens``, the id and the
    vocabulary now, as the id in a prompt is; an id inside it decodes as before."""
    config = ServerConfig()
    good = byte_tokenizer.encode("hi")
    if with_tokenizer:
        tokenizers = pytest.importorskip("tokenizers")
        from tokenizers import models, pre_tokenizers
        tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(tmp_path / "tokenizer.json"))
        config, good = ServerConfig(tokenizer_path=str(tmp_path / "tokenizer.json")), [5]
    with openai_server(tmp_path, config) as (server, _, service):
        vocab = service.contracts.vocab_size
        answer = httpx.post(f"{server.url}/detokenize", json={"tokens": [*good, 200000]},
                            timeout=30)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "tokens", error
        assert error["message"] == (f"tokens[{len(good)}]=200000 outside the vocabulary "
                                    f"[0, {vocab})"), error
        edge = httpx.post(f"{server.url}/detokenize", json={"tokens": [vocab]}, timeout=30)
        assert edge.status_code == 400 and "tokens[0]=" in edge.json()["error"]["message"]
        fine = httpx.post(f"{server.url}/detokenize", json={"tokens": good}, timeout=30)
        assert fine.status_code == 200
        assert fine.json()["prompt"] == ("hello" if with_tokenizer else "hi")
